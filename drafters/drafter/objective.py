"""Block loss of the DFlash drafter: KL to the target (or CE to the data) at every drafted slot.

Slot k (1..B-1) of the block anchored at a predicts the token at a + k (same-position labels); the
target's distribution for that token is lm_head(target final normed hidden at a + k - 1). Slot 0 is
the anchor itself and has no loss. Vocabulary projections run in chunks of rows and each chunk's
gradient is taken in the forward pass, so at most one chunk of full-vocabulary logits is ever alive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Paper: gamma 7 for block 16, 5 for block 10, 4 for block 8.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, max(1.0, (block_size - 1) / 2))


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1 (index 0 of the result is slot 1)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass
class BlockTargets:
    """Where each drafted slot's supervision comes from, for a batch of anchored blocks."""

    positions: torch.Tensor  # [Bsz, N, B-1] absolute position a + k of the predicted token
    valid: torch.Tensor      # [Bsz, N, B-1] inside the sequence, inside the loss mask, anchor real


def block_targets(anchors: torch.Tensor, anchor_valid: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                  on_greedy_path: torch.Tensor | None = None) -> BlockTargets:
    """Same-position labels: slot k of the block at anchor a is supervised by token a + k.

    on_greedy_path [Bsz, T] (optional): token p is the target's greedy choice given tokens < p. With it,
    slot k is supervised only while tokens a+1 .. a+k-1 all are: then the target's distribution at
    a+k-1 is exactly what greedy verification of this block would compare slot k with, whoever wrote
    the text. Without it the text is assumed to be the target's own (regenerated) output.
    """
    seq_len = loss_mask.shape[1]
    offsets = torch.arange(1, block_size, device=anchors.device)
    positions = anchors[..., None] + offsets  # [Bsz, N, B-1]
    inside = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1)
    in_mask = torch.gather(loss_mask.bool(), 1, clamped.flatten(1)).view_as(positions)
    valid = inside & in_mask & anchor_valid[..., None]
    if on_greedy_path is not None:
        greedy = torch.gather(on_greedy_path.bool(), 1, clamped.flatten(1)).view_as(positions) & inside
        # Slot k needs tokens a+1 .. a+k-1 on the greedy path: an exclusive running AND over the slots.
        prefix_ok = torch.cumprod(greedy.long(), dim=-1).bool()
        valid &= torch.cat([torch.ones_like(prefix_ok[..., :1]), prefix_ok[..., :-1]], dim=-1)
    return BlockTargets(positions=clamped, valid=valid)


@torch.no_grad()
def target_choices(target_final_hidden: torch.Tensor, lm_head_weight: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """[Bsz, T] long: the target's greedy next token after each position, argmax lm_head(final hidden at p)."""
    bsz, seq_len, hidden = target_final_hidden.shape
    rows = target_final_hidden.reshape(-1, hidden)
    return torch.cat([(rows[i : i + chunk_rows].to(lm_head_weight.dtype) @ lm_head_weight.T).argmax(-1)
                      for i in range(0, len(rows), chunk_rows)]).view(bsz, seq_len)


def greedy_path(input_ids: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """[Bsz, T] bool: token p is the target's greedy choice after p - 1 (position 0: False)."""
    on_path = torch.zeros_like(input_ids, dtype=torch.bool)
    on_path[:, 1:] = choices[:, :-1] == input_ids[:, 1:]
    return on_path


class HeadVocabulary:
    """The rows of the frozen lm_head that training projects onto; serving always uses the full head.

    The vocabulary projection is most of a CPU training step (vocab 49,152 x hidden 576 here); the
    tokens a target actually emits on the training data are a small part of its vocabulary. Draft and
    target logits are taken over those rows only (the KL renormalised over them); a label outside
    them is dropped from the loss and counted as a miss.
    """

    def __init__(self, lm_head_weight: torch.Tensor, token_ids: torch.Tensor | None = None):
        vocab = lm_head_weight.shape[0]
        if token_ids is None:
            self.weight, self.index_of, self.size = lm_head_weight, None, vocab
            return
        token_ids = torch.unique(token_ids.long())
        if len(token_ids) == 0 or int(token_ids[0]) < 0 or int(token_ids[-1]) >= vocab:
            raise ValueError(f"head vocabulary ids must lie in [0, {vocab}) and not be empty")
        self.weight = lm_head_weight[token_ids.to(lm_head_weight.device)].contiguous()
        self.index_of = torch.full((vocab,), -1, dtype=torch.long, device=lm_head_weight.device)
        self.index_of[token_ids.to(lm_head_weight.device)] = torch.arange(len(token_ids), device=lm_head_weight.device)
        self.size = len(token_ids)

    def local(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary ids -> row indices of this head (-1 outside it)."""
        return token_ids if self.index_of is None else self.index_of[token_ids]


def most_frequent_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` token ids with the highest counts (never one that was not seen)."""
    present = int((counts > 0).sum())
    return torch.topk(counts, min(size, present)).indices


@dataclass
class LossOutput:
    loss: torch.Tensor          # scalar, weighted mean over valid slots
    slot_correct: torch.Tensor  # [Bsz, N, B-1] bool: draft argmax == target's choice
    slot_valid: torch.Tensor    # [Bsz, N, B-1] bool
    copy_mass: torch.Tensor | None = None  # with train.copy_heads: slot 0's attention mass on the copy sources
    copy_value_loss: torch.Tensor | None = None  # with train.copy_value_weight: CE of the copy heads' readout


class _VocabLoss(torch.autograd.Function):
    """Weighted KL/CE over the vocabulary, chunked, with the gradient computed in the forward pass.

    For logits z = h W^T, d(loss)/dh = (softmax(z/T) - p) W / T, so each chunk needs its logits only
    once: no logits are kept for the backward pass and none are recomputed (3 vocabulary matmuls per
    row with KL, 2 with CE, against 5-6 for autograd with activation checkpointing).

    tv_eta (CE only): the LK hybrid of CE and total variation (arXiv 2602.23881). Against a one-hot label y,
    TV is 1 - q(y) (the drafter's probability of the label), whose gradient is q(y) times CE's: it spends
    the step on rows the drafter can win instead of rows it cannot. Row loss lam * CE + (1 - lam) * (1 - q(y)),
    lam = exp(-tv_eta * alpha) with alpha the chunk's mean q(y) (no gradient): TV takes over as the drafter
    improves, CE alone starts it (TV's gradient vanishes while q(y) is small).
    """

    @staticmethod
    def forward(ctx, draft_rows, target_rows, labels, weights, lm_head, kind, temperature, chunk_rows, tv_eta):
        need_grad = draft_rows.requires_grad
        grad = torch.zeros_like(draft_rows, dtype=torch.float32) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=draft_rows.device)
        correct = torch.zeros(len(labels), dtype=torch.bool, device=draft_rows.device)
        for start in range(0, len(labels), chunk_rows):
            sl = slice(start, start + chunk_rows)
            draft_logits = (draft_rows[sl].to(lm_head.dtype) @ lm_head.T).float()
            draft_logp = F.log_softmax(draft_logits / temperature, dim=-1)
            if kind == "kl":
                target_logits = (target_rows[sl].to(lm_head.dtype) @ lm_head.T).float()
                choice = target_logits.argmax(-1)
                target_logp = F.log_softmax(target_logits / temperature, dim=-1)
                target_p = target_logp.exp()
                per_row = (target_p * (target_logp - draft_logp)).sum(-1)
                del target_logits, target_logp
            else:
                known = labels[sl] >= 0  # a label outside a reduced head: no loss, a miss
                choice = labels[sl].clamp_min(0)
                label_logp = draft_logp.gather(-1, choice[:, None])[:, 0]
                per_row = -label_logp * known
            row_weights = weights[sl] if kind == "kl" else weights[sl] * known
            grad_weights = row_weights
            if tv_eta is not None:
                label_p = label_logp.exp() * known
                alpha = (label_p * row_weights).sum() / row_weights.sum().clamp_min(1e-6)
                lam = torch.exp(-tv_eta * alpha)
                per_row = lam * per_row + (1 - lam) * (1 - label_p) * known
                # d/dz (1 - q(y)) is q(y) times d/dz CE, so the row's gradient is (lam + (1 - lam) q(y)) times CE's.
                grad_weights = row_weights * (lam + (1 - lam) * label_p)
            total += (per_row * row_weights).sum()
            correct[sl] = draft_logits.argmax(-1) == choice
            if kind != "kl":
                correct[sl] &= known
            if need_grad:
                g = draft_logp.exp_()  # softmax, in place of the log-probabilities
                if kind == "kl":
                    g -= target_p
                else:
                    g[torch.arange(len(choice), device=g.device), choice] -= 1.0
                g *= (grad_weights / temperature)[:, None]
                grad[sl] = (g.to(lm_head.dtype) @ lm_head).float()
        if need_grad:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_total, None, None, None, None, None, None, None, None


def block_loss(
    draft_hidden: torch.Tensor,
    targets: BlockTargets,
    target_final_hidden: torch.Tensor | None,
    input_ids: torch.Tensor,
    head: torch.Tensor | HeadVocabulary,
    *,
    gamma: float,
    choices: torch.Tensor | None = None,
    kind: str = "kl",
    temperature: float = 1.0,
    chunk_rows: int = 1024,
    sample_slots: torch.Generator | None = None,
    tv_eta: float | None = None,
) -> LossOutput:
    """draft_hidden: [Bsz, N, B, H] (slot 0 included, ignored); target_final_hidden: [Bsz, T, H].

    kind: "kl" to the target's distribution, "ce" to the data tokens, "ce_target" to the target's
    greedy tokens (choices [Bsz, T] from target_choices; no target logits in the step at all).
    head: the lm_head weight, or a HeadVocabulary (a subset of its rows).

    sample_slots: instead of weighting slot k by w_k, keep it with probability w_k (weight 1). One
    uniform per block keeps a prefix of its slots; the loss is the same in expectation for about
    sum(w) / (B-1) of the vocabulary projections (44% at gamma 7, block 16). slot_valid then marks the
    kept slots; pass slot_weights(...) to acceptance_stats as keep_prob.

    tv_eta: with "ce" / "ce_target", the LK hybrid of CE and total variation (_VocabLoss); None: plain CE.
    """
    if kind not in ("kl", "ce", "ce_target"):
        raise ValueError(f"loss kind must be 'kl', 'ce' or 'ce_target', got {kind!r}")
    if kind == "kl" and target_final_hidden is None:
        raise ValueError("the KL loss needs the target's final normed hidden states")
    if kind == "ce_target" and choices is None:
        raise ValueError("the ce_target loss needs the target's greedy choices")
    if kind == "kl" and tv_eta is not None:
        raise ValueError("tv_eta (the CE/TV hybrid) applies to the ce and ce_target losses, not kl")
    head = head if isinstance(head, HeadVocabulary) else HeadVocabulary(head)
    bsz, n_blocks, block_size, hidden = draft_hidden.shape
    weights = slot_weights(block_size, gamma, draft_hidden.device).expand(bsz, n_blocks, -1)
    expected_weight = (weights * targets.valid).sum()
    if sample_slots is not None:
        u = torch.rand(bsz, n_blocks, 1, generator=sample_slots).to(draft_hidden.device)
        targets = BlockTargets(targets.positions, targets.valid & (u < weights))
        weights = torch.ones_like(weights)
    rows = targets.valid.nonzero(as_tuple=True)  # (b, n, k-1) of every supervised slot
    batch_idx, pos = rows[0], targets.positions[rows]
    draft_rows = draft_hidden[:, :, 1:][rows]
    # The target predicts token p from its hidden state at p - 1.
    labels = head.local(choices[batch_idx, pos - 1] if kind == "ce_target" else input_ids[batch_idx, pos])
    target_rows = target_final_hidden[batch_idx, pos - 1] if kind == "kl" else draft_rows.new_empty(len(pos), 0)
    row_weights = weights[rows]

    total, correct = _VocabLoss.apply(draft_rows, target_rows, labels, row_weights, head.weight,
                                      "kl" if kind == "kl" else "ce", temperature, chunk_rows, tv_eta)
    slot_correct = torch.zeros_like(targets.valid)
    slot_correct[rows] = correct
    loss = total / expected_weight.clamp_min(1e-6)
    return LossOutput(loss=loss, slot_correct=slot_correct, slot_valid=targets.valid)


@dataclass
class CopyLoss:
    loss: torch.Tensor  # scalar: mean -log(attention mass on the copy sources) over lookups that have one
    mass: torch.Tensor  # scalar, no gradient: the mean of that mass
    lookups: int        # (block, head) pairs with a copy source


def copy_sources(input_ids: torch.Tensor, attention_mask: torch.Tensor, anchors: torch.Tensor,
                 anchor_valid: torch.Tensor, num_offsets: int, context_len: int) -> torch.Tensor:
    """[Bsz, N, num_offsets, context_len] bool: where the block at a can copy slot m + 1 from.

    Position s < a is a source for offset o = m + 1 when token s - o equals the anchor token a and token s
    equals token a + o: the lookup prompt lookup does, keyed on the one token a first-layer slot-0 query
    knows, and kept only where copying gives the right token.
    """
    seq_len = input_ids.shape[1]
    ctx = input_ids[:, None, :context_len]                               # [Bsz, 1, ctx]
    anchor_tok = torch.gather(input_ids, 1, anchors)[..., None]          # [Bsz, N, 1]
    positions = torch.arange(context_len, device=input_ids.device)
    before = positions < anchors[..., None]                              # s < a
    matches = []
    for offset in range(1, num_offsets + 1):
        follows = torch.zeros(*anchors.shape, context_len, dtype=torch.bool, device=input_ids.device)
        follows[..., offset:] = (ctx == anchor_tok)[..., : context_len - offset]
        target_pos = (anchors + offset).clamp(max=seq_len - 1)
        real = (anchors + offset < seq_len) & torch.gather(attention_mask.bool(), 1, target_pos) & anchor_valid
        right = ctx == torch.gather(input_ids, 1, target_pos)[..., None]
        matches.append(follows & right & before & real[..., None])
    return torch.stack(matches, dim=2)


def copy_loss(copy_logp: torch.Tensor, sources: torch.Tensor) -> CopyLoss:
    """copy_logp, sources [Bsz, N, heads, ctx]: teach head m to put its attention on offset m + 1's sources."""
    has_source = sources.any(-1)
    log_mass = copy_logp.masked_fill(~sources, float("-inf")).logsumexp(-1)[has_source]
    if log_mass.numel() == 0:  # no lookup has a source: nothing to teach (copy_logp holds -inf, so no sum * 0)
        zero = copy_logp.new_zeros(())
        return CopyLoss(loss=zero, mass=zero, lookups=0)
    return CopyLoss(loss=-log_mass.mean(), mass=log_mass.detach().exp().mean(), lookups=int(has_source.sum()))


def copy_reads(sources: torch.Tensor, max_rows: int, generator: torch.Generator | None = None):
    """(batch indices, positions, head indices) [R]: the context positions copy head m reads, a source of its offset
    for some block (copy_sources), at most max_rows of them (a random subset)."""
    batch_idx, head_idx, positions = sources.any(1).nonzero(as_tuple=True)
    if len(batch_idx) > max_rows:
        keep = torch.randperm(len(batch_idx), generator=generator)[:max_rows].to(batch_idx.device)
        batch_idx, head_idx, positions = batch_idx[keep], head_idx[keep], positions[keep]
    return batch_idx, positions, head_idx


def copy_value_loss(writes: torch.Tensor, tokens: torch.Tensor, head: HeadVocabulary, chunk_rows: int = 1024) -> torch.Tensor:
    """writes [R, H]: what a copy head writes from a source (DFlashDrafter.head_writes); tokens [R]: the token there.
    Mean CE of the lm_head's readout to that token: pointing at the source copies it only if this is low."""
    if len(tokens) == 0:
        return writes.sum() * 0
    labels = head.local(tokens)
    ones = torch.ones(len(labels), device=writes.device)
    total, _ = _VocabLoss.apply(writes.float(), writes.new_empty(len(labels), 0), labels, ones, head.weight, "ce", 1.0,
                                chunk_rows, None)
    return total / len(labels)


def acceptance_stats(slot_correct: torch.Tensor, slot_valid: torch.Tensor, keep_prob: torch.Tensor | None = None) -> dict:
    """Per-slot accuracy and the simulated acceptance length under teacher forcing.

    A block accepts slot k only if slots 1..k are all right, so the simulated tau is
    1 + sum_k P(slots 1..k correct) = 1 + sum_k prod_{j<=k} (accuracy of slot j given 1..j-1 right).
    Blocks are counted only over the slots they supervise. keep_prob [B-1]: the probability that
    block_loss(sample_slots=...) kept each slot; each kept slot then counts 1 / keep_prob (unbiased).
    """
    correct = (slot_correct & slot_valid).float().flatten(0, -2)
    valid = slot_valid.float().flatten(0, -2)
    leading = torch.cumprod(torch.where(valid.bool(), correct, torch.ones_like(correct)), dim=-1) * valid
    if keep_prob is not None:
        leading = leading / keep_prob.to(leading)
    counted = valid.sum(0).clamp_min(1)
    per_slot_acc = (correct.sum(0) / counted).tolist()
    full_blocks = valid[:, 0].bool()
    sim_tau = 1.0 + (leading[full_blocks].sum(-1).mean().item() if full_blocks.any() else 0.0)
    return {"slot_accuracy": per_slot_acc, "sim_tau": sim_tau if math.isfinite(sim_tau) else 1.0}
