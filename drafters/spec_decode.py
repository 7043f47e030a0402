"""Speculative decoding with a DFlash drafter and an HF target, for evaluation (batch size 1).

Each step drafts one block [anchor, B-1 drafts] from the draft context, verifies it with one target
pass over the target's KV cache, keeps the accepted prefix plus one target token, and feeds the
accepted tokens' target features (from the same verify pass, via capture hooks) to the draft context.
T = 0 accepts while drafts equal the target's argmax; T > 0 uses rejection sampling, so the output is
distributed exactly as the target's own samples. Step accounting matches the reference
`dflash_generate`: an acceptance length is the number of tokens a step committed (bonus included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from drafters.capture import HFCapture, crop_cache
from drafters.frozen_target import FrozenTargetHead
from drafters.model import DFlashDrafter, DraftCache
from drafters.recurrent_state import has_recurrent_state, snapshot


@dataclass
class Generated:
    output_ids: torch.Tensor                 # [1, prompt + new] prompt included
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


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


@torch.no_grad()
def generate(
    drafter: DFlashDrafter,
    target,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_ids: list[int] | None = None,
    temperature: float = 0.0,
    *,
    head: FrozenTargetHead | None = None,
    capture: HFCapture | None = None,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
) -> Generated:
    """input_ids [1, n]. Returns the prompt plus at most max_new_tokens tokens, stopping after a stop id."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"generate runs one sequence at a time, got batch {input_ids.shape[0]}")
    head = head or FrozenTargetHead.from_model(target)
    own_capture = capture is None
    capture = capture or HFCapture(target, drafter.target_layer_ids)
    block_size = block_size or drafter.block_size
    stops = set(stop_ids or [])
    device = head.embed_tokens.weight.device
    input_ids = input_ids.to(device)
    try:
        target_cache = DynamicCache(config=target.config)
        recurrent = has_recurrent_state(target.config)  # rejected drafts cannot be cropped out of its state
        draft_cache = DraftCache()
        prompt = capture.capture(input_ids, past_key_values=target_cache)
        logits = head.logits(prompt.final_hidden[:, -1]).float()[0]
        first = int(logits.argmax()) if temperature <= 0 else int(torch.multinomial(_probs(logits, temperature).cpu(), 1, generator=generator))
        tokens = [first]
        steps: list[int] = []
        context = prompt.selected  # target features not yet in the draft cache
        n_prompt = input_ids.shape[1]
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            start = n_prompt + len(tokens) - 1  # position of the anchor (last committed token)
            room = max_new_tokens - len(tokens)
            size = min(block_size, room + 1)
            block = torch.full((1, size), drafter.mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = tokens[-1]
            hidden = drafter.step(context, head.embed(block), start, draft_cache)
            draft_logits = head.logits(hidden[0, 1:]).float()
            if temperature <= 0:
                drafts = draft_logits.argmax(-1)
            else:
                draft_probs = _probs(draft_logits, temperature)
                drafts = torch.multinomial(draft_probs.cpu(), 1, generator=generator)[:, 0].to(device)
            block[0, 1:] = drafts
            before_verify = snapshot(target_cache) if recurrent else None
            verify = capture.capture(block, past_key_values=target_cache,
                                     position_ids=torch.arange(start, start + size, device=device)[None])
            target_logits = head.logits(verify.final_hidden[0]).float()
            if temperature <= 0:
                accepted, bonus = accept_greedy(drafts, target_logits)
            else:
                accepted, bonus = accept_sampled(drafts, draft_probs, _probs(target_logits, temperature), generator)
            new = drafts[:accepted].tolist() + [bonus]
            new = new[:room]
            for i, tok in enumerate(new):
                if tok in stops:
                    new = new[: i + 1]
                    break
            tokens += new
            steps.append(len(new))
            # Features of the anchor and the accepted drafts; the last new token is the next anchor.
            context = verify.selected[:, : len(new)]
            if recurrent and len(new) < size:  # back to the state before the block, then the accepted tokens only
                target_cache = before_verify
                context = capture.capture(block[:, : len(new)], past_key_values=target_cache,
                                          position_ids=torch.arange(start, start + len(new), device=device)[None]).selected
            else:
                crop_cache(target_cache, start + len(new))
        ids = torch.cat([input_ids, torch.tensor([tokens], device=device)], dim=1)
        return Generated(ids, steps)
    finally:
        if own_capture:
            capture.remove()
