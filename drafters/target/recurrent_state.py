"""Targets with recurrent layers (linear attention, Mamba / SSM: Qwen3-Next, MiniMax, Kimi Linear, ...).

Speculative decoding verifies a block of drafts in one target pass and then drops the rejected ones. A KV
cache drops them by cropping; a recurrent layer has already folded them into its state, and no crop can
take them out (transformers' linear-attention cache layers restore only their conv window). So for such a
target the decode loop keeps a copy of the cache from before the verify pass and, when drafts were
rejected, returns to it and runs the accepted tokens again: one more target pass over at most a block,
and the state is exactly the one the accepted tokens alone would give.
"""

from __future__ import annotations

import copy

RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "deltanet", "kda", "recurrent", "ssm")


def recurrent_layer_types(config) -> list[str]:
    """The target's layer types that carry recurrent state (empty for attention-only targets)."""
    text = getattr(config, "text_config", None) or config
    types = list(getattr(text, "layer_types", None) or [])
    types += list(getattr(text, "layers_block_type", None) or [])  # Jamba / Zamba / Granite-hybrid naming
    return sorted({t for t in types if any(r in str(t).lower() for r in RECURRENT_LAYER_TYPES)})


def has_recurrent_state(config) -> bool:
    return bool(recurrent_layer_types(config))


def snapshot(cache):
    """An independent copy of a cache (KV and recurrent states) to return to after a rejected block."""
    return copy.deepcopy(cache)
