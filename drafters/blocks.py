"""Anchored blocks for training: where blocks sit, what they contain, and what they may attend to.

A block anchored at position a holds [token a, MASK x (B-1)] at positions a .. a+B-1. Slot k predicts
the token at a + k (same-position labels; slot 0 has no loss). The block sees the target context at
positions < a (strict: the target features at a already encode token a + 1) and its own B slots.
"""

from __future__ import annotations

import torch


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., N] anchors -> [..., N, B] absolute positions a + k of every slot."""
    return anchors[..., None] + torch.arange(block_size, device=anchors.device)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """[Bsz, T] ids, [Bsz, N] anchors -> [Bsz, N, B] block ids: the anchor token, then MASK."""
    ids = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[..., 0] = torch.gather(input_ids, 1, anchors)
    return ids


def training_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean SDPA mask [Bsz, 1, N*B, context_len + N*B] (True = may attend).

    Keys are [context positions 0..context_len-1 ; all N blocks' slots in order]. A query in block n
    sees context positions < anchors[n] and the B slots of block n, nothing else.
    """
    bsz, n = anchors.shape
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [Bsz, N*B]
    context = torch.arange(context_len, device=anchors.device)
    sees_context = context[None, None, :] < query_anchor[:, :, None]  # [Bsz, N*B, ctx]
    block_id = torch.arange(n, device=anchors.device).repeat_interleave(block_size)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(bsz, -1, -1)  # [Bsz, N*B, N*B]
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


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
