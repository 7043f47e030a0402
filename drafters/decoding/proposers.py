"""What proposes the drafts the target verifies: a DFlash drafter, prompt lookup (n-grams), both, or nothing.

A proposer is asked for drafts once per decode step (``propose``) and told which tokens the target
committed (``commit``). ``layer_ids`` names the target layers whose outputs it reads; the decode loop
(``drafters.decoding.spec_decode.decode``) captures exactly those from the passes it runs anyway, so a proposer
never costs a target forward of its own.

Prompt lookup is the training-free option users have today (transformers' ``prompt_lookup_num_tokens``,
vLLM's and SGLang's ``ngram`` speculative method): take the last n tokens of the context (prompt +
generated so far), n from ``max_ngram`` down to ``min_ngram``, find their first (earliest) earlier
occurrence in the context, as transformers and vLLM do, and propose up to ``num_draft`` tokens that
followed it. No match: no draft, and the step is an ordinary decode step.

The drafter with lookup (``DrafterWithLookup``) takes lookup's draft when the context's last ``min_match`` or more
tokens recur earlier (copy work: edits, restated code, quoted text) and the drafter's otherwise. Where they recur
more than once with different continuations (a file restated with edits, a line that recurs in several functions),
the drafter chooses: the continuation that agrees longest with its own draft (``agreeing_continuation``).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from drafters.drafter.model import DFlashDrafter, DraftCache
from drafters.target.frozen import FrozenTargetHead


# Which engine serves the drafter with lookup (eval's report and the export's model card say it).
COMBINATION_SERVING = (
    "vLLM 0.32 and SGLang run one speculative method per server (vLLM: `dflash`, `ngram`, `suffix`, ...; SGLang: "
    "`DFLASH`, `NGRAM`, ...), with no per-request choice, so neither serves the drafter with lookup today (vLLM's pull "
    "request 24344, n-gram drafts with a model drafter's fallback, is open). Until one does: serve the winner of the "
    "traffic that dominates, or run two servers of the same target, one with the drafter and one with `ngram` "
    "(prompt lookup), and route edit and agent traffic to the second. Our own decoder "
    "(`drafters.decoding.spec_decode.generate(..., lookup=...)`) runs the combination.")


class Proposal(NamedTuple):
    drafts: list[int]
    # [len(drafts), V] the distribution each draft was sampled from (T > 0); None: the drafts were chosen,
    # not sampled (a point mass on each).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    layer_ids: list[int]  # target layers whose outputs propose() reads; [] for none

    def start(self, prompt_features: torch.Tensor | None) -> None:
        """Called once after the prompt's prefill, with its captured features [1, n, K*H] (None without layers)."""

    def propose(self, context: np.ndarray, room: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        """Drafts to follow ``context`` (prompt + committed tokens; its last token is the anchor), at most ``room``."""

    def commit(self, features: torch.Tensor | None) -> None:
        """The features [1, n, K*H] of the anchor and the accepted drafts of the last step (None without layers)."""


def ngram_matches(context: np.ndarray | list[int], max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, np.ndarray]:
    """(n, where the continuation of every earlier occurrence of the context's last n tokens starts, earliest
    first) for the largest n in [min_ngram, max_ngram] that has one; (0, []) when none matches."""
    context = np.asarray(context)
    length = context.shape[0]
    if length >= 2:
        for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
            pattern = context[length - n:]
            # Windows of context[:-1] start at 0 .. length - 1 - n: every occurrence except the suffix itself,
            # and each is followed by at least one token.
            windows = sliding_window_view(context[: length - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                return n, hits + n
    return 0, np.zeros(0, dtype=np.int64)


def agreeing_continuation(context: np.ndarray | list[int], starts: np.ndarray, draft: list[int],
                          num_draft: int) -> tuple[list[int], int]:
    """Of the continuations context[s: s + num_draft] for s in ``starts``, the one whose first tokens agree longest
    with ``draft`` (the earliest on ties, so with no agreement it is ``ngram_lookup``'s), and how many agree."""
    context = np.asarray(context)
    padded = np.concatenate([context, np.full(num_draft, -1, dtype=context.dtype)])
    continuations = padded[np.asarray(starts)[:, None] + np.arange(num_draft)]  # [occurrences, num_draft]
    room = min(num_draft, len(draft))
    agree = np.cumprod(continuations[:, :room] == np.asarray(draft[:room], dtype=context.dtype), axis=1).sum(axis=1)
    best = int(np.argmax(agree))
    return [int(t) for t in continuations[best] if t >= 0], int(agree[best])


def ngram_lookup(context: np.ndarray | list[int], max_ngram: int = 3, min_ngram: int = 1, num_draft: int = 15) -> list[int]:
    """Up to ``num_draft`` tokens that followed the earliest earlier occurrence of the context's last n
    tokens, for the largest n in [min_ngram, max_ngram] that has one; [] when none matches."""
    if num_draft <= 0:
        return []
    _, starts = ngram_matches(context, max_ngram, min_ngram)
    if not starts.size:
        return []
    start = int(starts[0])
    return np.asarray(context)[start: start + num_draft].tolist()


class TargetOnly:
    """No drafts: every step is one ordinary decode step of the target (the baseline and T = 0 ground truth)."""

    layer_ids: list[int] = []

    def start(self, prompt_features) -> None:
        pass

    def propose(self, context, room, temperature, generator) -> Proposal:
        return Proposal([])

    def commit(self, features) -> None:
        pass


class PromptLookup(TargetOnly):
    """Drafts copied from the context by ``ngram_lookup``."""

    def __init__(self, num_draft: int = 15, max_ngram: int = 3, min_ngram: int = 1):
        self.num_draft, self.max_ngram, self.min_ngram = num_draft, max_ngram, min_ngram

    def propose(self, context, room, temperature, generator) -> Proposal:
        if self.num_draft <= 0:
            return Proposal([])
        return Proposal(ngram_lookup(context, self.max_ngram, self.min_ngram, min(self.num_draft, room)))


class DFlashProposer:
    """A DFlash drafter: one block [anchor, B-1 masks] per step, denoised in one drafter pass from the target
    features of every committed token (kept in the drafter's own KV cache)."""

    def __init__(self, drafter: DFlashDrafter, head: FrozenTargetHead, block_size: int | None = None):
        self.drafter, self.head = drafter, head
        self.layer_ids = list(drafter.target_layer_ids)
        self.block_size = block_size or drafter.block_size
        self.cache = DraftCache()
        self.pending: torch.Tensor | None = None  # target features not yet in the drafter's cache

    def start(self, prompt_features: torch.Tensor) -> None:
        self.cache, self.pending = DraftCache(), prompt_features

    def propose(self, context: np.ndarray, room: int, temperature: float, generator) -> Proposal:
        device = self.head.embed_tokens.weight.device
        size = min(self.block_size, room + 1)
        block = torch.full((1, size), self.drafter.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = int(context[-1])
        anchor_position = len(context) - 1
        hidden = self.drafter.step(self.pending, self.head.embed(block), anchor_position, self.cache)
        self.pending = self.pending[:, :0]
        logits = self.head.logits(hidden[0, 1:]).float()
        if temperature <= 0:
            return Proposal(logits.argmax(-1).tolist())
        probs = torch.softmax(logits / temperature, dim=-1)
        drafts = torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0]
        return Proposal(drafts.tolist(), probs)

    def commit(self, features: torch.Tensor) -> None:
        # Steps another proposer drafted leave their features here until the drafter runs again.
        self.pending = torch.cat([self.pending, features], dim=1)


class DrafterWithLookup:
    """Prompt lookup's draft when the context's last ``min_match`` (or more, up to ``lookup.max_ngram``) tokens
    recur earlier in the context, the drafter's otherwise; where they recur with different continuations, the one
    that agrees longest with the drafter's draft (the earliest when none does). The drafter still reads every
    committed token's features, so its cache stays whole across the steps lookup drafts."""

    def __init__(self, drafter: DFlashProposer, lookup: PromptLookup, min_match: int = 2):
        self.drafter, self.lookup, self.min_match = drafter, lookup, min_match
        self.layer_ids = drafter.layer_ids

    def start(self, prompt_features: torch.Tensor) -> None:
        self.drafter.start(prompt_features)

    def propose(self, context: np.ndarray, room: int, temperature: float, generator) -> Proposal:
        num_draft = min(self.lookup.num_draft, room)
        n, starts = ngram_matches(context, max(self.lookup.max_ngram, self.min_match), self.min_match)
        if not n or num_draft <= 0:
            return self.drafter.propose(context, room, temperature, generator)
        continuations = {tuple(context[s: s + num_draft]) for s in starts.tolist()}
        if len(continuations) == 1:
            return Proposal([int(t) for t in continuations.pop()])
        drafted = self.drafter.propose(context, room, temperature, generator)
        return Proposal(agreeing_continuation(context, starts, drafted.drafts, num_draft)[0])

    def commit(self, features: torch.Tensor) -> None:
        self.drafter.commit(features)
