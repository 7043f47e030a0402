"""The one table from a dtype's name in configs and on command lines to the torch dtype."""

from __future__ import annotations

import torch

TORCH_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """"bf16" / "bfloat16" / torch.bfloat16 -> torch.bfloat16; an unknown name is a KeyError naming the known ones."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return TORCH_DTYPES[str(name)]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r} (expected one of {sorted(TORCH_DTYPES)})") from None
