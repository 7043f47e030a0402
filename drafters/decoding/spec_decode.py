"""Speculative decoding of one prompt against an HF target: the one decode loop, whatever proposes the drafts.

Each step asks the proposer (``drafters.decoding.proposers``: a DFlash drafter, prompt lookup, or nothing) for
drafts after the anchor (the last committed token), verifies [anchor, drafts...] with one target pass
over the target's KV cache, and commits the accepted drafts plus one target token: the acceptance length
of that step, bonus included, as in the reference ``dflash_generate``. The first token comes from the
prefill; generation stops after ``max_new_tokens`` or after a stop id.

T = 0 accepts drafts while they equal the target's argmax, so the output is exactly the target's greedy
output. T > 0 uses rejection sampling (a sampled draft against the distribution it came from; a chosen
draft, as prompt lookup's, against a point mass), so the output is distributed as the target's own
samples. The proposer's target features come from the same passes (capture hooks on the layers it
names), never from a pass of their own. A target with recurrent layers cannot crop rejected drafts out
of its state: the loop returns it to a copy taken before the block and replays the accepted tokens
(``drafters/target/recurrent_state.py``).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from transformers import DynamicCache

from drafters.decoding.proposers import (
    DFlashProposer,
    DrafterWithLookup,
    PromptLookup,
    Proposer,
    TargetOnly,
)
from drafters.drafter.model import DFlashDrafter
from drafters.target.capture import HFCapture, crop_cache
from drafters.target.frozen import FrozenTargetHead
from drafters.target.recurrent_state import has_recurrent_state, snapshot


@dataclass
class Decoded:
    """One decode of one prompt. ``tokens`` are the new tokens only; ``output_ids`` puts the prompt before them."""

    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    proposed: list[int] = field(default_factory=list)  # drafts proposed per verify step
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def decode_seconds(self) -> float:
        return max(self.total_seconds - self.prefill_seconds, 0.0)

    @property
    def output_ids(self) -> torch.Tensor:
        return torch.tensor([self.prompt_ids + self.tokens], dtype=torch.long)


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """drafts [n], target_logits [n+1, V] (row j predicts the token after block slot j).

    Returns (accepted drafts, the target's next token after them).
    """
    choice = target_logits.argmax(-1)
    accepted = int((drafts == choice[:-1]).int().cumprod(0).sum())
    return accepted, int(choice[accepted])


def accept_sampled(drafts, draft_probs, target_probs, generator=None) -> tuple[int, int]:
    """Rejection sampling: keep draft j with prob min(1, p_j(x)/q_j(x)); on the first rejection sample
    from normalize(max(p_j - q_j, 0)); if all pass, sample the bonus from p_n.
    drafts [n], draft_probs [n, V], target_probs [n+1, V]."""
    n = drafts.shape[0]
    idx = torch.arange(n, device=drafts.device)
    p = target_probs[idx, drafts]
    q = draft_probs[idx, drafts]
    u = torch.rand(n, generator=generator, device="cpu").to(p.device)
    accepted = int((u * q < p).int().cumprod(0).sum())
    if accepted == n:
        dist = target_probs[n]
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
        dist = residual / residual.sum() if residual.sum() > 0 else target_probs[accepted]
    token = torch.multinomial(dist.cpu(), 1, generator=generator)
    return accepted, int(token)


def _accept(drafts: torch.Tensor, draft_probs, logits: torch.Tensor, temperature: float, generator) -> tuple[int, int]:
    if temperature <= 0:
        return accept_greedy(drafts, logits)
    if draft_probs is None:  # chosen drafts: a point mass on each
        draft_probs = torch.zeros(drafts.shape[0], logits.shape[-1], device=logits.device)
        draft_probs[torch.arange(drafts.shape[0], device=logits.device), drafts] = 1.0
    return accept_sampled(drafts, draft_probs, torch.softmax(logits / temperature, dim=-1), generator)


def _pick(logits: torch.Tensor, temperature: float, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits / temperature, dim=-1).cpu(), 1, generator=generator))


class TargetPass(NamedTuple):
    logits: torch.Tensor | None    # [rows, V] float32
    features: torch.Tensor | None  # [1, T, K*H] the proposer's layers; None when it reads none


class TargetRunner:
    """Runs the target over its KV cache. A proposer that reads target layers gets them from capture hooks
    (logits from the frozen head); otherwise the target's own forward, computing only the logits rows asked for."""

    def __init__(self, target, layer_ids: list[int], head: FrozenTargetHead | None = None,
                 capture: HFCapture | None = None):
        self.target = target
        self.capture = capture if capture is not None or not layer_ids else HFCapture(target, layer_ids)
        self.owns_capture = capture is None and self.capture is not None
        if self.capture is not None:
            self.head = head or FrozenTargetHead.from_model(target)
            self.device = self.head.embed_tokens.weight.device
        else:
            self.device = target.get_input_embeddings().weight.device
            # transformers >= 5.24 names the KV-cache argument ``cache`` (``past_key_values`` before).
            self.cache_kwarg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"

    def run(self, ids: torch.Tensor, cache, positions: torch.Tensor | None = None, rows: str | None = "all") -> TargetPass:
        """rows: "all" (a verify pass), "last" (the prefill) or None (a replay: only the cache and features matter)."""
        if self.capture is not None:
            out = self.capture.capture(ids, past_key_values=cache, position_ids=positions)
            final = None if rows is None else out.final_hidden[0] if rows == "all" else out.final_hidden[0, -1:]
            return TargetPass(None if final is None else self.head.logits(final).float(), out.selected)
        keep = {} if rows == "all" else {"logits_to_keep": 1}
        out = self.target(input_ids=ids, use_cache=True, position_ids=positions, **keep, **{self.cache_kwarg: cache})
        return TargetPass(out.logits[0].float() if rows == "all" else out.logits[0, -1:].float(), None)

    def close(self) -> None:
        if self.owns_capture:
            self.capture.remove()


def _committed(tokens: list[int], room: int, stops: set[int]) -> list[int]:
    """The tokens a step commits: at most ``room``, and none after a stop id."""
    tokens = tokens[:room]
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def decode(target, input_ids: torch.Tensor, proposer: Proposer, max_new_tokens: int, stop_ids=None,
           temperature: float = 0.0, *, head: FrozenTargetHead | None = None, capture: HFCapture | None = None,
           generator: torch.Generator | None = None) -> Decoded:
    """input_ids [1, n]. At most max_new_tokens new tokens, stopping after a stop id."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"one sequence at a time, got batch {input_ids.shape[0]}")
    runner = TargetRunner(target, proposer.layer_ids, head, capture)
    try:
        return _decode(runner, input_ids, proposer, max_new_tokens, set(stop_ids or []), temperature, generator)
    finally:
        runner.close()


def _decode(runner: TargetRunner, input_ids, proposer: Proposer, max_new_tokens: int, stops: set[int],
            temperature: float, generator) -> Decoded:
    device = runner.device
    input_ids = input_ids.to(device)
    n_prompt = input_ids.shape[1]
    context = np.empty(n_prompt + max_new_tokens, dtype=np.int64)  # prompt + committed tokens
    context[:n_prompt] = input_ids[0].cpu().numpy()
    started = time.perf_counter()
    cache = DynamicCache(config=runner.target.config)
    recurrent = has_recurrent_state(runner.target.config)  # rejected drafts cannot be cropped out of its state
    prompt = runner.run(input_ids, cache, rows="last")
    tokens = [_pick(prompt.logits[-1], temperature, generator)]
    context[n_prompt] = tokens[0]
    prefill = time.perf_counter() - started
    proposer.start(prompt.features)
    steps: list[int] = []
    proposed: list[int] = []
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        start = n_prompt + len(tokens) - 1  # position of the anchor (last committed token)
        room = max_new_tokens - len(tokens)
        proposal = proposer.propose(context[: start + 1], room, temperature, generator)
        block = torch.tensor([[tokens[-1]] + proposal.drafts], dtype=torch.long, device=device)
        size = block.shape[1]
        positions = torch.arange(start, start + size, device=device)[None]
        before_verify = snapshot(cache) if recurrent and size > 1 else None
        verify = runner.run(block, cache, positions)
        accepted, bonus = _accept(block[0, 1:], proposal.probs, verify.logits, temperature, generator)
        new = _committed(proposal.drafts[:accepted] + [bonus], room, stops)
        context[start + 1: start + 1 + len(new)] = new
        tokens += new
        steps.append(len(new))
        proposed.append(len(proposal.drafts))
        # Features of the anchor and the accepted drafts; the last new token is the next anchor.
        features = None if verify.features is None else verify.features[:, : len(new)]
        if before_verify is not None and len(new) < size:  # back to the state before the block, then the accepted tokens
            cache = before_verify
            features = runner.run(block[:, : len(new)], cache, positions[:, : len(new)], rows=None).features
        else:
            crop_cache(cache, start + len(new))
        proposer.commit(features)
    total = time.perf_counter() - started
    return Decoded(tokens, steps, prefill, total, proposed, input_ids[0].tolist())


def generate(drafter: DFlashDrafter, target, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=None,
             temperature: float = 0.0, *, head: FrozenTargetHead | None = None, capture: HFCapture | None = None,
             block_size: int | None = None, generator: torch.Generator | None = None,
             lookup: PromptLookup | None = None, min_match: int = 2) -> Decoded:
    """Speculative decoding with a DFlash drafter; with ``lookup``, lookup's draft on the steps where the context's
    last ``min_match`` tokens recur earlier, chosen among their occurrences by the drafter (``DrafterWithLookup``)."""
    head = head or FrozenTargetHead.from_model(target)
    proposer = DFlashProposer(drafter, head, block_size)
    if lookup is not None:
        proposer = DrafterWithLookup(proposer, lookup, min_match)
    return decode(target, input_ids, proposer, max_new_tokens, stop_ids, temperature,
                  head=head, capture=capture, generator=generator)


def lookup_generate(target, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=None, temperature: float = 0.0,
                    *, num_draft: int = 15, max_ngram: int = 3, min_ngram: int = 1,
                    generator: torch.Generator | None = None) -> Decoded:
    """Prompt-lookup (n-gram) speculative decoding; ``num_draft=0`` is the target alone."""
    return decode(target, input_ids, PromptLookup(num_draft, max_ngram, min_ngram), max_new_tokens, stop_ids,
                  temperature, generator=generator)


def target_generate(target, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=None, temperature: float = 0.0,
                    *, generator: torch.Generator | None = None) -> Decoded:
    """The target decoding alone with its KV cache (the baseline, and the T = 0 ground truth)."""
    return decode(target, input_ids, TargetOnly(), max_new_tokens, stop_ids, temperature, generator=generator)
