"""The DFlash block drafter: Qwen3-style decoder layers whose attention also reads the target's features.

Every draft layer attends over [context ; block]: the context keys/values are k_proj/v_proj of the
fused target features (fc + hidden_norm of K concatenated target layers, shared by all layers, not
passed through the layers), the block keys/values and all queries come from the block tokens. Token
embeddings and the vocabulary projection belong to the frozen target (drafters.target.frozen), so the
state dict holds exactly the reference checkpoint's names.

Two entry points share the same layers:
  forward: training; N anchored blocks per sequence in one pass, masked as in drafters.drafter.blocks. Call the
           module (drafter(features, input_ids, anchors, embed)), so DDP/accelerate wrappers see it.
  step:          inference; a DraftCache holds context K/V only, block K/V are never committed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from drafters.drafter.blocks import BlockAttention, block_input_ids, block_positions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, weight applied in the input dtype: bit-compatible with Qwen3RMSNorm.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, d]; cos/sin [B, L, d]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DraftAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim)

    def keys_values(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """h [B, L, H] -> normed, rotated keys and values [B, kv_heads, L, d]."""
        k = self.k_norm(self._heads(self.k_proj(h), self.n_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(h), self.n_kv_heads).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(self, x, rope, prefix_k, prefix_v, blocks=None, return_qk=False):
        """x [B, Lq, H] block tokens at positions given by rope; prefix_k/v: the context's K/V.
        blocks: how the block attends: the training forward's N anchored blocks (BlockAttention), a decode step's
        (StepAttention), or None: x is one block that sees all the context.
        return_qk: also return the queries and the block's own keys (for the copy loss)."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)).transpose(1, 2), *rope)
        k, v = self.keys_values(x, rope)
        gqa = self.n_heads != self.n_kv_heads
        if blocks is None:
            out = F.scaled_dot_product_attention(q, torch.cat([prefix_k, k], 2), torch.cat([prefix_v, v], 2), enable_gqa=gqa)
        else:
            out = blocks(q, prefix_k, prefix_v, k, v, enable_gqa=gqa)
        out = self.o_proj(out.transpose(1, 2).flatten(2))
        return (out, q, k) if return_qk else out


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, prefix_k, prefix_v, blocks=None, return_qk=False):
        attended = self.self_attn(self.input_layernorm(x), rope, prefix_k, prefix_v, blocks, return_qk)
        if return_qk:
            attended, q, k = attended
        x = x + attended
        x = x + self.mlp(self.post_attention_layernorm(x))
        return (x, q, k) if return_qk else x


class DraftCache:
    """Per-layer context keys/values of the draft model. Only context is committed; a step's block keys/values are
    written after it for that step's attention (``with_block``) and overwritten by the next step.

    The keys/values live in buffers that grow by doubling, so a step appends its new context and joins its block
    without copying what the cache holds: at 8K context a copy per step would cost more than the attention. With a
    sliding window the positions no later query sees are forgotten (``forget_before``) and the buffers stay about
    two windows long."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []    # [B, kv_heads, capacity, d]; index 0 holds position self.base
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []          # per layer: positions committed (absolute)
        self.base = 0                         # absolute position of buffer index 0
        self.first = 0                        # first position still attended to

    @property
    def length(self) -> int:
        return self.lengths[0] if self.lengths else 0

    def _room(self, layer: int, like: torch.Tensor, end: int) -> None:
        needed = end - self.base
        if layer == len(self.keys):
            shape = (*like.shape[:2], max(needed, 64), like.shape[-1])
            self.keys.append(like.new_empty(shape))
            self.values.append(like.new_empty(shape))
            self.lengths.append(self.base)
        elif self.keys[layer].shape[2] < needed:
            kept = self.lengths[layer] - self.base
            capacity = max(needed, 2 * self.keys[layer].shape[2])
            for buffers in (self.keys, self.values):
                grown = buffers[layer].new_empty((*buffers[layer].shape[:2], capacity, buffers[layer].shape[-1]))
                grown[:, :, :kept] = buffers[layer][:, :, :kept]
                buffers[layer] = grown

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        start = self.lengths[layer] if layer < len(self.lengths) else self.base
        end = start + k.shape[2]
        self._room(layer, k, end)
        self.keys[layer][:, :, start - self.base:end - self.base] = k
        self.values[layer][:, :, start - self.base:end - self.base] = v
        visible = slice(self.first - self.base, end - self.base)
        return end, self.keys[layer][:, :, visible], self.values[layer][:, :, visible]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit new context keys/values [B, kv_heads, n, d]; returns the layer's attended context (views)."""
        end, keys, values = self._write(layer, k, v)
        self.lengths[layer] = end
        return keys, values

    def with_block(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[attended context ; block] keys/values (views) for one step's attention; the block is not committed."""
        _, keys, values = self._write(layer, k, v)
        return keys, values

    def forget_before(self, position: int) -> None:
        """No query will attend before ``position``: stop returning it, and reclaim the room once it is half the
        buffer (one copy of what is kept, so the cost per position stays constant)."""
        self.first = max(self.first, min(position, self.length))
        if self.keys and self.first - self.base > self.keys[0].shape[2] // 2:
            drop = self.first - self.base
            for buffers in (self.keys, self.values):
                for layer, buffer in enumerate(buffers):
                    kept = self.lengths[layer] - self.first
                    buffer[:, :, :kept] = buffer[:, :, drop:drop + kept].clone()
            self.base = self.first

    def crop(self, length: int) -> None:
        """Forget the context after ``length`` positions (the buffers stay)."""
        if length < self.first:
            raise ValueError(f"cannot crop the draft cache to {length}: positions before {self.first} are forgotten")
        self.lengths = [min(n, length) for n in self.lengths]


class StepAttention:
    """A decode step's attention: one block over the cached context, through the cache's buffers (no copy), with
    the sliding window's edge masked per query (a query at position p sees keys after p - window)."""

    def __init__(self, cache: DraftCache, layer: int, mask: torch.Tensor | None):
        self.cache, self.layer, self.mask = cache, layer, mask

    def __call__(self, q, context_k, context_v, block_k, block_v, enable_gqa: bool) -> torch.Tensor:
        k, v = self.cache.with_block(self.layer, block_k, block_v)
        # A strided query takes SDPA's slow CPU path: 2x the step at 8K context.
        return F.scaled_dot_product_attention(q.contiguous(), k, v, attn_mask=self.mask, enable_gqa=enable_gqa)


def step_window_mask(first: int, start: int, block: int, window: int | None, device) -> torch.Tensor | None:
    """[block, keys] visibility of context positions first .. start - 1 and the block for queries at start .. start +
    block - 1; None when every query sees every key."""
    if window is None or start - first + block <= window:
        return None
    query = torch.arange(start, start + block, device=device)[:, None]
    context = torch.arange(first, start, device=device)[None, :]
    sees_context = query - context < window
    return torch.cat([sees_context, torch.ones(block, block, dtype=torch.bool, device=device)], dim=1)


def dflash_settings(config: Qwen3Config) -> tuple[list[int], int | None, int]:
    """(target_layer_ids, mask_token_id, block_size) from a reference-format config."""
    extra = getattr(config, "dflash_config", None) or {}
    layer_ids = list(extra.get("target_layer_ids", getattr(config, "target_layer_ids", None)) or [])
    mask_token_id = extra.get("mask_token_id", getattr(config, "mask_token_id", None))
    block_size = int(extra.get("block_size", getattr(config, "block_size", 16)))
    if not layer_ids:
        raise ValueError("drafter config has no dflash_config.target_layer_ids")
    return layer_ids, mask_token_id, block_size


def draft_window(config: Qwen3Config) -> int | None:
    """The draft attention's sliding window from a reference-format config (vLLM's ``dflash_config.use_swa`` /
    ``swa_window_size``, which drafters.drafter.config writes beside the Qwen3 keys); None: full attention."""
    extra = getattr(config, "dflash_config", None) or {}
    return int(extra["swa_window_size"]) if extra.get("use_swa") else None


class DFlashDrafter(nn.Module):
    # Blocks per SDPA call in the training forward (drafters.drafter.blocks.BlockAttention); any value gives the same
    # numbers, and one at least the anchor count is a single dense masked attention (BENCHMARKS.md, issue 12).
    attention_group_blocks = 16

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.target_layer_ids, self.mask_token_id, self.block_size = dflash_settings(config)
        self.sliding_window = draft_window(config)
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        # Kept outside the module tree so that .to(bfloat16) cannot round inv_freq (RoPE stays fp32).
        self.__dict__["_rotary"] = Qwen3RotaryEmbedding(config)
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        std = getattr(self.config, "initializer_range", 0.02) if std is None else std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[..., K*H] concatenated target layers -> [..., H] draft context."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor):
        if self._rotary.inv_freq.device != x.device:
            self._rotary.to(x.device)
        return self._rotary(x, positions)

    def forward(self, target_features, input_ids, anchors, embed, copy_heads: int = 0, copy_query: str = "slot",
                copy_reads: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Training forward: draft hidden states for N anchored blocks per sequence, in one pass.

        target_features: [Bsz, T, K*H] concatenated target layer outputs at every position.
        input_ids: [Bsz, T] the sequence (block slot 0 is input_ids[a]).
        anchors: [Bsz, N] long positions a with 0 <= a < T (any order; duplicates allowed).
        embed: the target's frozen token embedding (callable ids -> [.., H]).
        Returns [Bsz, N, B, H], normed, before the lm_head; slot k predicts input_ids[a + k].
        copy_heads > 0: returns (hidden, copy_logp) with copy_logp [Bsz, N, copy_heads, ctx_len], the
        attention log-probabilities over the context of head copy_head_ids()[m] for lookup m: from slot 0
        in the first layer (copy_query "anchor"), or from slot m + 1 in the last layer ("slot").
        copy_reads (batch indices, positions) [R] each, with copy_heads: also returns what each copy head writes
        from those positions (head_writes, [R, copy_heads, H]) as a third output.
        """
        bsz, n = anchors.shape
        b = self.block_size
        # Context beyond the last anchor is visible to no block.
        ctx_len = max(int(anchors.max()), 1)
        context = self.fuse(target_features[:, :ctx_len])
        x = embed(block_input_ids(input_ids, anchors, b, self.mask_token_id)).flatten(1, 2).to(context.dtype)
        ctx_positions = torch.arange(ctx_len, device=x.device).expand(bsz, -1)
        block_rope = self._rope(x, block_positions(anchors, b).flatten(1))
        ctx_rope = self._rope(context, ctx_positions)
        blocks = BlockAttention(anchors, ctx_len, b, self.attention_group_blocks, self.sliding_window)
        copy_layer = self.copy_layer(copy_query)
        copy_logp = None
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(context, ctx_rope)
            if i == copy_layer and copy_heads:
                x, queries, block_keys = layer(x, block_rope, k, v, blocks, return_qk=True)
                slots = [0] * copy_heads if copy_query == "anchor" else list(range(1, copy_heads + 1))
                group = queries.shape[1] // k.shape[1]
                copy_logp = torch.stack([blocks.context_log_probs(queries, k, block_keys, head, head // group, slot)
                                         for head, slot in zip(self.copy_head_ids(copy_heads), slots)], dim=2)
            else:
                x = layer(x, block_rope, k, v, blocks)
        hidden = self.norm(x).view(bsz, n, b, -1)
        if copy_logp is None:
            return hidden
        if copy_reads is None:
            return hidden, copy_logp
        rows, positions = copy_reads
        return hidden, copy_logp, self.head_writes(context[rows, positions], self.copy_head_ids(copy_heads), copy_layer)

    def copy_layer(self, copy_query: str) -> int:
        return 0 if copy_query == "anchor" else len(self.layers) - 1

    def head_writes(self, context: torch.Tensor, heads: list[int], layer: int) -> torch.Tensor:
        """[..., len(heads), H]: what each query head of `layer` adds to the residual from one context position (its
        fused features, [..., H]) when all its attention is there (o_proj's slice for the head times the value),
        through the final norm: the token a copy from that position would write."""
        attn = self.layers[layer].self_attn
        values = attn.v_proj(context).unflatten(-1, (attn.n_kv_heads, attn.head_dim))
        group = attn.n_heads // attn.n_kv_heads
        d = attn.head_dim
        writes = [values[..., h // group, :] @ attn.o_proj.weight[:, h * d:(h + 1) * d].T for h in heads]
        return self.norm(torch.stack(writes, dim=-2))

    def copy_head_ids(self, copy_heads: int) -> list[int]:
        """One query head per key/value group first, so that each lookup gets its own keys and values."""
        attn = self.layers[0].self_attn
        group = attn.n_heads // attn.n_kv_heads
        order = [g * group + r for r in range(group) for g in range(attn.n_kv_heads)]
        if not 0 < copy_heads <= min(len(order), self.block_size - 1):
            raise ValueError(f"copy_heads must be in 1..{min(len(order), self.block_size - 1)}, got {copy_heads}")
        return order[:copy_heads]

    def step(self, new_target_features, block_embeds, start: int, cache: DraftCache) -> torch.Tensor:
        """One inference draft: append context, draft a block, leave only context in the cache.

        new_target_features: [Bsz, n_new, K*H] for positions start - n_new .. start - 1 (the tokens
            accepted since the last step; the prompt on the first step). n_new may be 0.
        block_embeds: [Bsz, Bq, H] embedded [anchor, MASK...] at positions start .. start + Bq - 1.
        Returns [Bsz, Bq, H] normed draft hidden states (slot 0 is the anchor).
        """
        n_new = new_target_features.shape[1]
        if cache.length + n_new != start:
            raise ValueError(f"draft cache holds {cache.length} + {n_new} new context tokens, but the block starts at {start}")
        bsz, bq = block_embeds.shape[:2]
        context = self.fuse(new_target_features)
        x = block_embeds.to(context.dtype)
        device = x.device
        ctx_rope = self._rope(context, torch.arange(start - n_new, start, device=device).expand(bsz, -1))
        block_rope = self._rope(x, torch.arange(start, start + bq, device=device).expand(bsz, -1))
        if self.sliding_window is not None:  # the first query (at start) sees positions after start - window
            cache.forget_before(start - self.sliding_window + 1)
        mask = step_window_mask(cache.first, start, bq, self.sliding_window, device)
        for i, layer in enumerate(self.layers):
            k, v = cache.extend(i, *layer.self_attn.keys_values(context, ctx_rope))
            x = layer(x, block_rope, k, v, StepAttention(cache, i, mask))
        return self.norm(x)
