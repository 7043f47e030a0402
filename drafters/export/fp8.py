"""DeepSeek-style block FP8 for drafter exports: quantize, dequantize, and load an FP8 export back.

Format (what SGLang's and vLLM's `Fp8Config` with `weight_block_size` load, and DeepSeek-V3 ships):
each quantized Linear stores
  `<module>.weight`            float8_e4m3fn [out, in]
  `<module>.weight_scale_inv`  float32 [ceil(out / 128), ceil(in / 128)]
with, per 128 x 128 block b (partial blocks at the right/bottom edges included):
  scale_b = amax(|w_b|) / 448          (448 = largest finite e4m3fn value; 1.0 for an all-zero block)
  weight_b = round_to_e4m3(w_b / scale_b)
  dequantized w_b = weight_b * scale_b  (despite its name, weight_scale_inv is multiplied in)

Quantized in a drafter: o_proj, the MLP (gate/up/down) and fc. Kept in bf16: q/k/v projections (SGLang's
DFlash model builds its fused qkv_proj without a quant config and slices the raw weight to project the
context K/V; vLLM's DFlash model slices `qkv_proj.weight` the same way) and every norm.

Error bound (e4m3fn: 3 mantissa bits, round to nearest): for every element,
  |w - dequant(w)| <= 2^-4 * |w| + 2^-10 * scale_b
The first term is half an ulp of a normal e4m3 value (ulp = 2^(e-3) for a value in [2^e, 2^(e+1)));
the second covers the subnormal range |w / scale_b| < 2^-6, where the spacing is 2^-9. Over a block
this gives max |error| <= 2^-4 * amax_b (the 2^-10 * scale_b term is below 2^-18 * amax_b); the largest
elements (|w / scale| in [256, 448]) see at most 16 / 448 * amax_b ~= 0.036 * amax_b.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from drafters.drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME
from drafters.drafter.model import DFlashDrafter

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK = (128, 128)
SCALE_SUFFIX = "weight_scale_inv"
# Per-element error bound (see the module docstring): REL * |w| + SUBNORMAL * scale.
ERROR_REL = 2.0 ** -4
ERROR_SUBNORMAL = 2.0 ** -10

# Reference-format names of the Linear weights stored in FP8.
QUANTIZED_WEIGHT = re.compile(r"^(layers\.\d+\.self_attn\.o_proj|layers\.\d+\.mlp\.(gate|up|down)_proj|fc)\.weight$")


def is_quantized_weight(name: str) -> bool:
    """True for the reference-format weights an FP8 export stores in float8_e4m3fn."""
    return QUANTIZED_WEIGHT.match(name) is not None


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`."""
    assert weight_name.endswith(".weight"), weight_name
    return weight_name[: -len("weight")] + SCALE_SUFFIX


def scale_shape(shape: tuple[int, int] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    out_features, in_features = shape
    return math.ceil(out_features / block[0]), math.ceil(in_features / block[1])


def _blocked(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[out, in] -> fp32 [n_out_blocks, bn, n_in_blocks, bk], zero-padded at the edges (a view when aligned)."""
    rows, cols = scale_shape(w.shape, block)
    if w.shape[0] == rows * block[0] and w.shape[1] == cols * block[1]:
        return w.float().view(rows, block[0], cols, block[1])
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=w.device)
    padded[: w.shape[0], : w.shape[1]] = w.float()
    return padded.view(rows, block[0], cols, block[1])


def _unblocked(x: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of _blocked: [rows, bn, cols, bk] -> [out, in] (edge padding cropped)."""
    rows, bn, cols, bk = x.shape
    return x.reshape(rows * bn, cols * bk)[: shape[0], : shape[1]]


def _expand(scale: torch.Tensor, shape, block: tuple[int, int]) -> torch.Tensor:
    """[rows, cols] block scales -> [out, in] per-element scales."""
    full = scale.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


@torch.no_grad()
def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight -> (float8_e4m3fn weight [out, in], float32 weight_scale_inv [ceil(out/bn), ceil(in/bk)]).

    The scale is computed from the weight in its own precision (fp32 or bf16), not from a bf16 copy.
    """
    if w.dim() != 2:
        raise ValueError(f"block FP8 needs a 2-D weight, got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight with NaN or Inf values")
    blocked = _blocked(w.detach().cpu(), block)
    amax = blocked.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = blocked / scale[:, None, :, None]
    # The fp32 division can overshoot 448 by an ulp; e4m3fn has no inf, so clamp before the cast.
    q = _unblocked(scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), w.shape)
    return q.contiguous(), scale.to(torch.float32).contiguous()


@torch.no_grad()
def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_block_fp8 (on whatever device the tensors are on; the loader uses the CPU)."""
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"expected a {FP8_DTYPE} weight, got {q.dtype}")
    expected = scale_shape(q.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} != {expected} for a weight of shape {tuple(q.shape)}")
    blocked = _blocked(q, block) * scale_inv.float()[:, None, :, None]
    return _unblocked(blocked, q.shape).to(dtype).contiguous()


def error_bound(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """Per-element bound on |w - dequant(quant(w))| (see the module docstring)."""
    return ERROR_REL * w.float().abs() + ERROR_SUBNORMAL * _expand(scale_inv, w.shape, block)


def quantization_config(num_layers: int, num_target_layers: int | None = None) -> dict:
    """config.json "quantization_config" of an FP8 drafter export.

    `ignored_layers` is the key SGLang's Fp8Config reads first (it also accepts
    `modules_to_not_convert`) and the only one vLLM's Fp8Config reads. It lists, per draft layer i:
      layers.i.self_attn.{q,k,v}_proj   the checkpoint's names; SGLang adds the "model."-prefixed
                                        variant itself and maps its fused qkv_proj onto these shards;
      layers.i.self_attn.qkv_proj       the fused module name, for SGLang versions that compare the
                                        fused prefix directly (no packed_modules_mapping on DFlash);
      model.layers.{T+i}.self_attn.{q,k,v,qkv}_proj   vLLM's module prefixes: its DFlash model names draft
                                        layer i `model.layers.{T+i}` (T = the target's layer count,
                                        `num_target_layers`) and matches ignored_layers exactly. Its DFlash
                                        quant config has no packed_modules_mapping, so it compares the fused
                                        qkv_proj prefix as it is: without that name vLLM 0.32 quantizes the bf16
                                        q/k/v, never loads their scales (left at float32's minimum), and every
                                        draft is rejected (tau 1.00 with the real target, BENCHMARKS.md).
    `modules_to_not_convert` repeats the list for transformers' FineGrainedFP8Config.
    """
    ignored: list[str] = []
    for i in range(num_layers):
        ignored += [f"layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "qkv_proj")]
    if num_target_layers is not None:
        for i in range(num_layers):
            ignored += [f"model.layers.{num_target_layers + i}.self_attn.{p}"
                        for p in ("q_proj", "k_proj", "v_proj", "qkv_proj")]
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
        "ignored_layers": ignored,
        "modules_to_not_convert": list(ignored),
    }


def quantize_state_dict(state: dict[str, torch.Tensor], block: tuple[int, int] = BLOCK,
                        keep_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Reference-format state dict -> FP8 export state dict (quantized weights + scales, the rest bf16)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_quantized_weight(name):
            q, s = quantize_block_fp8(tensor, block)
            out[name] = q
            out[scale_name(name)] = s
        else:
            out[name] = tensor.detach().to("cpu", keep_dtype).contiguous()
    return out


def dequantize_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                          block: tuple[int, int] = BLOCK) -> dict[str, torch.Tensor]:
    """FP8 export state dict -> reference-format state dict in `dtype` (scales consumed)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("." + SCALE_SUFFIX):
            continue
        if tensor.dtype == FP8_DTYPE:
            sname = scale_name(name)
            if sname not in state:
                raise ValueError(f"FP8 weight {name} has no {sname}")
            out[name] = dequantize_block_fp8(tensor, state[sname], block, dtype)
        else:
            out[name] = tensor.to(dtype)
    return out


def block_size_of(config: dict) -> tuple[int, int]:
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        raise ValueError(f"not an FP8 export: quantization_config = {quant!r}")
    block = quant.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size must be [n, k], got {block!r}")
    return int(block[0]), int(block[1])


def load_fp8_drafter(path: str | Path, dtype: torch.dtype = torch.bfloat16, device=None):
    """Load an FP8 export (config.json + model.safetensors) into a DFlashDrafter, dequantized on the CPU."""
    path = Path(path)
    raw = json.loads((path / CONFIG_NAME).read_text())
    block = block_size_of(raw)
    raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    config = Qwen3Config.from_dict(raw)
    state = dequantize_state_dict(load_file(str(path / WEIGHTS_NAME), device="cpu"), torch.float32, block)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(state, strict=True)
    return drafter.to(device=device, dtype=dtype)
