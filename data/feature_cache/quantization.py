"""How features are stored: bf16, or float8_e4m3fn with a float32 scale per token and per tensor."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
CACHE_DTYPES = ("bf16", "fp8")


def quantize_fp8(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, D]`` -> (``q [N, D]`` float8_e4m3fn, ``scale [N, groups]`` float32).

    The last dim is split into ``groups`` equal tensors; each (token, group) gets scale = amax / 448.
    """
    n, d = x.shape
    if d % groups:
        raise ValueError(f"dim {d} is not divisible into {groups} groups")
    xf = x.float().reshape(n, groups, d // groups)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if not torch.isfinite(amax).all():
        raise ValueError("non-finite target features (NaN/inf) cannot be stored; check the target's dtype")
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, d), scale.reshape(n, groups)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, d = q.shape
    g = scale.shape[-1]
    out = q.float().reshape(n, g, d // g) * scale.float().reshape(n, g, 1)
    return out.reshape(n, d).to(dtype)


def feature_bytes_per_token(num_layers_selected: int, hidden_size: int, dtype: str) -> int:
    """Bytes one token costs in a shard: features (+ fp8 scales) + the int32 token id."""
    k, h = num_layers_selected, hidden_size
    if dtype == "bf16":
        return (k + 1) * h * 2 + 4
    if dtype == "fp8":
        return (k + 1) * h + (k + 1) * 4 + 4
    raise ValueError(f"unknown cache dtype {dtype!r} (expected one of {CACHE_DTYPES})")


def encode_features(selected: torch.Tensor, final_hidden: torch.Tensor, ids: torch.Tensor, dtype: str,
                    num_layers_selected: int) -> dict[str, torch.Tensor]:
    """One segment in storage form on the CPU (quantised on the capture device: only stored bytes cross)."""
    tensors = {"input_ids": ids.to(torch.int32).cpu()}
    if dtype == "fp8":
        q, s = quantize_fp8(selected, num_layers_selected)
        qf, sf = quantize_fp8(final_hidden, 1)
        tensors.update(selected=q.cpu(), selected_scale=s.cpu(), final_hidden=qf.cpu(), final_scale=sf.cpu())
    else:
        tensors.update(selected=selected.to(torch.bfloat16).cpu(), final_hidden=final_hidden.to(torch.bfloat16).cpu())
    return tensors
