"""The target's attention kernel on a CPU: torch's SDPA with grouped key/value heads, padding mask included.

transformers' `sdpa` repeats every key/value head up to the query heads (`repeat_kv`) whenever a padding mask
is present, because on CUDA masked grouped-query SDPA falls back to the math kernel. On a CPU torch runs
masked `enable_gqa=True` in its own kernel, so the copy buys nothing. It is paid in every layer at every decode
step, over the whole KV cache (SmolLM2: 3 key/value heads for 9 query heads), and it was most of a batched
decode step's time on the testbed (BENCHMARKS.md, "Grouped attention").
The outputs are the same numbers: the kernel sees the same keys and values, only not copied.

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
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


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
