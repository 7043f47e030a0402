"""The target's attention kernel on a CPU: torch's SDPA with grouped key/value heads, padding mask included.

transformers' `sdpa` repeats every key/value head up to the query heads (`repeat_kv`) whenever a padding mask
is present, because on CUDA masked grouped-query SDPA falls back to the math kernel. On a CPU torch runs
masked `enable_gqa=True` in its own kernel, so the copy buys nothing. It is paid in every layer at every decode
step, over the whole KV cache (SmolLM2: 3 key/value heads for 9 query heads), and it was most of a batched
decode step's time on the testbed (BENCHMARKS.md, "Grouped attention").
The outputs are the same numbers: the kernel sees the same keys and values, only not copied.

A batched decoding step (one query per sequence under a padding mask: regeneration, the agent simulator) skips
torch's flash kernel, which works in query blocks and spends most of such a step on a block of one query
(BENCHMARKS.md, "Batched decoding"). Each key/value head's query heads go through two grouped matrix
multiplies instead, with the scores in fp32 as the kernel keeps them. The eval decodes one sequence with no
padding mask and keeps the kernel.

`load_target_model` switches every target that runs on the CPU to it (`use_on_cpu`).
"""

from __future__ import annotations

ATTENTION = "sdpa_gqa"


def _sdpa_gqa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = query.shape[1] // key.shape[1]
    if (query.device.type != "cpu" or attention_mask is None or groups == 1
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None):
        # A target moved to an accelerator after loading gets the library's masked path; without a mask the
        # library already passes enable_gqa; position biases and paged caches are its own.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if query.shape[2] == 1:
        return _one_query_grouped(query, key, value, attention_mask, scaling), None
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def _one_query_grouped(query, key, value, attention_mask, scaling: float | None):
    """query [B, H, 1, D], key/value [B, KV, L, D], attention_mask [B or 1, 1, 1, L] (bool: attend, or additive)
    -> [B, 1, H, D]. Query head h reads key/value head h // (H / KV), as `repeat_kv` lays them out."""
    import torch

    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scores = grouped @ key.float().transpose(-1, -2) * (dim ** -0.5 if scaling is None else scaling)
    mask = attention_mask.reshape(attention_mask.shape[0], 1, 1, length)  # a batch of 1 broadcasts
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    output = scores.softmax(-1).to(value.dtype) @ value
    return output.reshape(batch, 1, heads, dim)


def register() -> str:
    """Makes `ATTENTION` known to transformers, with `sdpa`'s mask builder (registering again is harmless)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _sdpa_gqa_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


def use_on_cpu(model):
    """Switches a target that runs on the CPU from transformers' `sdpa` to `ATTENTION`; returns the model. A target
    on an accelerator, or with another attention (eager, a remote-code model's own), is left as it is."""
    devices = {p.device.type for p in model.parameters()}
    if getattr(model.config, "_attn_implementation", None) == "sdpa" and devices <= {"cpu", "meta"}:
        model.set_attn_implementation(register())
    return model
