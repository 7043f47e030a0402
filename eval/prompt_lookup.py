"""Target-verified decoding without a neural drafter: the target alone, and prompt-lookup (n-gram) drafting.

Prompt lookup is the training-free option users have today (transformers' ``prompt_lookup_num_tokens``,
vLLM's and SGLang's ``ngram`` speculative method): take the last n tokens of the context (prompt +
generated so far), n from ``max_ngram`` down to ``min_ngram``, find their first (earliest) earlier
occurrence in the context, as transformers and vLLM do, and propose up to ``num_draft`` tokens that
followed it. No match: no draft, and the step is an ordinary decode step.

Both loops use the same step accounting as ``drafters.spec_decode.generate`` (and the reference
``dflash_generate``): the first token comes from the prefill; every later target pass verifies
[anchor, drafts...] over the target's KV cache and commits the accepted drafts plus one target token
(the acceptance length of that step, bonus included); generation stops after ``max_new_tokens`` or after a
stop id. T = 0 accepts drafts while they equal the target's argmax, so the output is exactly the target's
greedy output; T > 0 uses rejection sampling with the point-mass proposal (accept draft x with probability
p(x), on rejection sample from p with x removed), so the output follows the target's distribution.
The target alone is the same loop with no drafts (acceptance length 1 at every step).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from transformers import DynamicCache

from drafters.capture import crop_cache
from drafters.recurrent_state import has_recurrent_state, snapshot
from drafters.spec_decode import accept_greedy, accept_sampled


@dataclass
class Decoded:
    """One decode of one prompt. ``tokens`` are the new tokens only (prompt excluded)."""

    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    proposed: list[int] = field(default_factory=list)  # drafted tokens per step (prompt lookup)

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def decode_seconds(self) -> float:
        return max(self.total_seconds - self.prefill_seconds, 0.0)


def propose(context: np.ndarray | list[int], max_ngram: int = 3, min_ngram: int = 1, num_draft: int = 15) -> list[int]:
    """Up to ``num_draft`` tokens that followed the earliest earlier occurrence of the context's last n
    tokens, for the largest n in [min_ngram, max_ngram] that has one; [] when none matches."""
    context = np.asarray(context)
    length = context.shape[0]
    if num_draft <= 0 or length < 2:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = context[length - n:]
        # Windows of context[:-1] start at 0 .. length - 1 - n: every occurrence except the suffix itself,
        # and each is followed by at least one token.
        windows = sliding_window_view(context[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return context[start: start + num_draft].tolist()
    return []


def cache_kwarg(model) -> str:
    """transformers >= 5.24 names the KV-cache argument ``cache`` (``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _pick(logits: torch.Tensor, temperature: float, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def lookup_generate(target, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=None, temperature: float = 0.0,
                    *, num_draft: int = 15, max_ngram: int = 3, min_ngram: int = 1,
                    generator: torch.Generator | None = None) -> Decoded:
    """Prompt-lookup speculative decoding of one prompt ([1, n] ids), verified by ``target``.

    ``num_draft=0`` is the target decoding alone (one token per target pass)."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"one sequence at a time, got batch {input_ids.shape[0]}")
    device = target.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    stops = set(stop_ids or [])
    n_prompt = input_ids.shape[1]
    context = np.empty(n_prompt + max_new_tokens, dtype=np.int64)
    context[:n_prompt] = input_ids[0].cpu().numpy()
    started = time.perf_counter()
    cache = DynamicCache(config=target.config)
    recurrent = has_recurrent_state(target.config)  # rejected drafts are replayed away (drafters/recurrent_state.py)
    kw = cache_kwarg(target)
    out = target(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{kw: cache})
    tokens = [_pick(out.logits[0, -1], temperature, generator)]
    context[n_prompt] = tokens[0]
    prefill = time.perf_counter() - started
    steps: list[int] = []
    proposed: list[int] = []
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        start = n_prompt + len(tokens) - 1  # position of the anchor (last committed token)
        room = max_new_tokens - len(tokens)
        drafts = propose(context[: start + 1], max_ngram, min_ngram, min(num_draft, room)) if num_draft > 0 else []
        block = torch.tensor([[tokens[-1]] + drafts], dtype=torch.long, device=device)
        size = block.shape[1]
        before_verify = snapshot(cache) if recurrent and size > 1 else None
        verify = target(input_ids=block, use_cache=True,
                        position_ids=torch.arange(start, start + size, device=device)[None], **{kw: cache})
        logits = verify.logits[0].float()
        draft_t = block[0, 1:]
        if temperature <= 0:
            accepted, bonus = accept_greedy(draft_t, logits)
        else:
            target_probs = torch.softmax(logits / temperature, dim=-1)
            point_mass = torch.zeros(len(drafts), logits.shape[-1], device=logits.device)
            point_mass[torch.arange(len(drafts), device=logits.device), draft_t] = 1.0
            accepted, bonus = accept_sampled(draft_t, point_mass, target_probs, generator)
        new = (drafts[:accepted] + [bonus])[:room]
        for i, tok in enumerate(new):
            if tok in stops:
                new = new[: i + 1]
                break
        context[start + 1: start + 1 + len(new)] = new
        tokens += new
        steps.append(len(new))
        proposed.append(len(drafts))
        if before_verify is not None and len(new) < size:
            cache = before_verify
            target(input_ids=block[:, : len(new)], use_cache=True, logits_to_keep=1,
                   position_ids=torch.arange(start, start + len(new), device=device)[None], **{kw: cache})
        else:
            crop_cache(cache, start + len(new))
    total = time.perf_counter() - started
    return Decoded(tokens, steps, prefill, total, proposed)


def target_generate(target, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=None, temperature: float = 0.0,
                    *, generator: torch.Generator | None = None) -> Decoded:
    """The target decoding alone with its KV cache (the baseline, and the T = 0 ground truth)."""
    return lookup_generate(target, input_ids, max_new_tokens, stop_ids, temperature, num_draft=0, generator=generator)
