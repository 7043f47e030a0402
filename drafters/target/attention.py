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

Batched generation keeps its keys in fp32 and its keys and values in buffers sized for the whole generation
(`decoding_cache`): the library's cache concatenates every layer's keys and values at every step, and the fp32
scores would convert all the keys again at every step (BENCHMARKS.md, "A decoding cache and a contiguous head
row"). Converting bf16 to fp32 is exact, so the numbers are the same. Only padded batches on targets with grouped
key/value heads take it: they are what the one-query path serves. An unpadded batch keeps the library's cache and
torch's kernel, the eval's numbers: a batch of one regenerates exactly the target's greedy output.

`load_target_model` switches every target that runs on the CPU to it (`use_on_cpu`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "sdpa_gqa"


def _sdpa_gqa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    groups = query.shape[1] // key.shape[1]
    library = (query.device.type != "cpu" or attention_mask is None or groups == 1
               or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None)
    if not library and query.shape[2] == 1:
        return _one_query_grouped(query, key, value, attention_mask, scaling), None
    key = key.to(query.dtype)  # a decoding_cache holds fp32 keys; the kernels take one dtype
    if library:
        # A target moved to an accelerator after loading gets the library's masked path; without a mask the
        # library already passes enable_gqa; position biases and paged caches are its own.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def _one_query_grouped(query, key, value, attention_mask, scaling: float | None):
    """query [B, H, 1, D], key/value [B, KV, L, D], attention_mask [B or 1, 1, 1, L] (bool: attend, or additive)
    -> [B, 1, H, D]. Query head h reads key/value head h // (H / KV), as `repeat_kv` lays them out."""
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scores = grouped @ key.float().transpose(-1, -2) * (dim ** -0.5 if scaling is None else scaling)
    mask = attention_mask.reshape(attention_mask.shape[0], 1, 1, length)  # a batch of 1 broadcasts
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    output = scores.softmax(-1).to(value.dtype) @ value
    return output.reshape(batch, 1, heads, dim)


def decoding_cache(model, attention_mask: torch.Tensor, capacity: int) -> Cache | None:
    """A cache for one batched `generate` of a left-padded batch (`attention_mask` [B, width]): fp32 keys and the
    model's values in buffers of `capacity` positions (a longer generation grows them). Only where the one-query
    path serves every decoding step: a padded batch, on a CPU target that attends with `ATTENTION` through grouped
    key/value heads, every layer full attention, whose cache holds plain keys (not MLA's latents). None otherwise,
    which keeps the library's cache (and for an unpadded batch torch's kernel, the eval's numbers)."""
    config = model.config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(config)
    eligible = (not bool(attention_mask.all())
                and getattr(model.config, "_attn_implementation", None) == ATTENTION
                and {p.device.type for p in model.parameters()} <= {"cpu"}
                and getattr(config, "num_key_value_heads", None) not in (None, config.num_attention_heads)
                and getattr(config, "kv_lora_rank", None) is None
                and set(layer_types) == {"full_attention"}
                and getattr(model.generation_config, "cache_implementation", None) is None)
    return Cache(layers=[BufferedLayer(capacity) for _ in layer_types]) if eligible else None


class BufferedLayer(DynamicLayer):
    """A cache layer that writes each step into preallocated buffers instead of concatenating, keys in fp32."""

    is_croppable = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = torch.float32, key_states.device
        self.key_buffer = _buffer_like(key_states, torch.float32, self.capacity)
        self.value_buffer = _buffer_like(value_states, value_states.dtype, self.capacity)
        self.length, self.is_initialized = 0, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self._grow(max(end, 2 * self.key_buffer.shape[-2]))
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = _buffer_like(old, old.dtype, capacity)
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)

    def reset(self) -> None:
        self.length, self.key_buffer, self.value_buffer = 0, None, None
        super().reset()

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("decoding_cache serves plain batched generation: no cropping, reordering or "
                                  "batch selection")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


def _buffer_like(states: torch.Tensor, dtype: torch.dtype, capacity: int) -> torch.Tensor:
    batch, heads, _, dim = states.shape
    return states.new_empty(batch, heads, capacity, dim, dtype=dtype)


def register() -> str:
    """Makes `ATTENTION` known to transformers, with `sdpa`'s mask builder (registering again is harmless)."""
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
