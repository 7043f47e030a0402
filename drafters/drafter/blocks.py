"""Anchored blocks for training: where blocks sit, what they contain, and what they may attend to.

A block anchored at position a holds [token a, MASK x (B-1)] at positions a .. a+B-1. Slot k predicts
the token at a + k (same-position labels; slot 0 has no loss). The block sees the target context at
positions < a (strict: the target features at a already encode token a + 1) and its own B slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., N] anchors -> [..., N, B] absolute positions a + k of every slot."""
    return anchors[..., None] + torch.arange(block_size, device=anchors.device)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """[Bsz, T] ids, [Bsz, N] anchors -> [Bsz, N, B] block ids: the anchor token, then MASK."""
    ids = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[..., 0] = torch.gather(input_ids, 1, anchors)
    return ids


def training_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int,
                            window: int | None = None) -> torch.Tensor:
    """Boolean SDPA mask [Bsz, 1, N*B, context_len + N*B] (True = may attend).

    Keys are [context positions 0..context_len-1 ; all N blocks' slots in order]. A query in block n
    sees context positions < anchors[n] and the B slots of block n, nothing else; with a sliding window, only the
    context positions after its own position - window (as vLLM and the reference count).
    """
    bsz, n = anchors.shape
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [Bsz, N*B]
    context = torch.arange(context_len, device=anchors.device)
    sees_context = context[None, None, :] < query_anchor[:, :, None]  # [Bsz, N*B, ctx]
    if window is not None:
        query_position = query_anchor + torch.arange(block_size, device=anchors.device).repeat(n)
        sees_context &= query_position[:, :, None] - context[None, None, :] < window
    block_id = torch.arange(n, device=anchors.device).repeat_interleave(block_size)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(bsz, -1, -1)  # [Bsz, N*B, N*B]
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


class BlockAttention:
    """The training forward's attention, in groups of consecutive blocks, so that it skips what no query sees.

    One SDPA over the whole context and all N*B block slots would score every query against every key and
    mask away most of it: the other blocks' slots, and the context at or after each anchor. Group g of
    group_blocks consecutive blocks instead runs one SDPA over the context before its last anchor and its own
    blocks' slots, masked by training_attention_mask. Anchors come sorted from sample_anchors, so a group's
    context is about as long as its queries need; any order stays correct, only slower.
    """

    def __init__(self, anchors: torch.Tensor, context_len: int, block_size: int, group_blocks: int = 16,
                 window: int | None = None):
        self.anchors, self.context_len, self.block_size, self.window = anchors, context_len, block_size, window
        self.groups = []  # (query rows, context length, mask)
        for start in range(0, anchors.shape[1], group_blocks):
            group = anchors[:, start : start + group_blocks]
            seen = min(max(int(group.max()), 0), context_len)
            rows = slice(start * block_size, (start + group.shape[1]) * block_size)
            self.groups.append((rows, seen, training_attention_mask(group, seen, block_size, window)))

    def __call__(self, q, context_k, context_v, block_k, block_v, enable_gqa: bool) -> torch.Tensor:
        """q [Bsz, heads, N*B, d]; context_k/v [Bsz, kv, ctx, d]; block_k/v [Bsz, kv, N*B, d] -> [Bsz, heads, N*B, d]."""
        out = []
        for rows, seen, mask in self.groups:
            k = torch.cat([context_k[:, :, :seen], block_k[:, :, rows]], dim=2)
            v = torch.cat([context_v[:, :, :seen], block_v[:, :, rows]], dim=2)
            out.append(F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=mask, enable_gqa=enable_gqa))
        return torch.cat(out, dim=2)

    def context_log_probs(self, q, context_k, block_k, head: int, kv_head: int, slot: int) -> torch.Tensor:
        """[Bsz, N, ctx] log-probabilities of one head's attention from one slot of every block over the context,
        normalised as its SDPA normalises them: over the visible context and the block's own slots."""
        bsz, n = self.anchors.shape
        rows = torch.arange(n, device=q.device) * self.block_size + slot
        query = q[:, head, rows].float()  # [Bsz, N, d]
        scale = query.shape[-1] ** -0.5
        context = (query @ context_k[:, kv_head].float().transpose(-1, -2)) * scale  # [Bsz, N, ctx]
        positions = torch.arange(context.shape[-1], device=q.device)
        visible = positions < self.anchors[..., None]
        if self.window is not None:
            visible &= (self.anchors[..., None] + slot) - positions < self.window
        context = context.masked_fill(~visible, float("-inf"))
        own_block = block_k[:, kv_head].float().view(bsz, n, self.block_size, -1)
        block = (own_block @ query[..., None]).squeeze(-1) * scale  # [Bsz, N, B]
        return context - torch.cat([context, block], dim=-1).logsumexp(-1, keepdim=True)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None):
    """Draw up to num_anchors distinct anchors per sequence where loss_mask[a] and loss_mask[a+1].

    Returns (anchors [Bsz, N] long, anchor_valid [Bsz, N] bool). Rows with fewer eligible positions
    than N are padded with anchor 0 marked invalid. Anchors come back sorted.
    """
    mask = loss_mask.bool()
    eligible = torch.zeros_like(mask)
    eligible[:, :-1] = mask[:, :-1] & mask[:, 1:]
    scores = torch.rand(mask.shape, generator=generator, device="cpu").to(mask.device)
    scores = scores.masked_fill(~eligible, -1.0)
    n = min(num_anchors, mask.shape[1])
    top, idx = scores.topk(n, dim=1)
    valid = top >= 0
    anchors = torch.where(valid, idx, torch.zeros_like(idx))
    # Sort valid anchors ascending and push padding to the end.
    key = torch.where(valid, anchors, torch.full_like(anchors, mask.shape[1]))
    order = key.argsort(dim=1)
    anchors, valid = anchors.gather(1, order), valid.gather(1, order)
    if n < num_anchors:
        pad = num_anchors - n
        anchors = torch.cat([anchors, anchors.new_zeros(anchors.shape[0], pad)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(valid.shape[0], pad)], dim=1)
    return anchors, valid
