"""The held-out split of corpus documents: by a salted sha256 of each document's split key (its group), the same
on every machine; a larger fraction only moves documents from train to held-out (see data/sources/builtin.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from data.sources.corpus import Document, load_documents

SPLITS = ("train", "heldout", "all")
DEFAULT_SALT = "dflash-heldout-v2"  # v1 held out no Shakespeare play at 0.1
DEFAULT_HELDOUT_FRACTION = 0.1


def unit_hash(text: str) -> float:
    """A number in [0, 1) from sha256: the same on every machine and in every Python run."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def heldout_score(split_key: str, salt: str = DEFAULT_SALT) -> float:
    return unit_hash(f"{salt}\x00{split_key}")


def split_documents(docs: Iterable[Document], heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, *,
                    salt: str = DEFAULT_SALT) -> tuple[list[Document], list[Document]]:
    """``(train, heldout)``, each in input order. A document is held out when the score of its split
    key is below ``heldout_fraction``. Where that holds out no group of a source (``Document.source``)
    that has at least two groups although the fraction is positive, that source's group with the
    lowest score is held out as well, so every source is represented in the held-out set. Documents
    of one group always land on the same side, and a larger fraction only adds held-out groups."""
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    docs = list(docs)
    scores = {d.split_key: heldout_score(d.split_key, salt) for d in docs}
    held = {k for k, s in scores.items() if s < heldout_fraction}
    if heldout_fraction > 0:
        by_source: dict[str, set[str]] = {}
        for d in docs:
            by_source.setdefault(d.source, set()).add(d.split_key)
        for keys in by_source.values():
            if len(keys) >= 2 and not keys & held:
                held.add(min(keys, key=lambda k: (scores[k], k)))
    train = [d for d in docs if d.split_key not in held]
    heldout = [d for d in docs if d.split_key in held]
    return train, heldout


def select_split(docs: Iterable[Document], split: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                 *, salt: str = DEFAULT_SALT) -> list[Document]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    docs = list(docs)
    if split == "all":
        return docs
    train, heldout = split_documents(docs, heldout_fraction, salt=salt)
    return train if split == "train" else heldout


def load_corpus(category: str, split: str = "train", heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, *,
                salt: str = DEFAULT_SALT, **loader_kwargs) -> list[Document]:
    """The documents of one category on one side of the split ("train", "heldout" or "all")."""
    return select_split(load_documents(category, **loader_kwargs), split, heldout_fraction, salt=salt)
