"""The one table from a dtype's name in configs (bf16, fp16, fp32) and on command lines to the torch dtype, and what
"auto" means."""

from __future__ import annotations

import functools

import torch

TORCH_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}

# CPU instruction sets that multiply bf16 natively; without them oneDNN emulates bf16 matmuls, which on an
# AVX2 CPU run about 5x slower than fp32 (BENCHMARKS.md, "Compute dtype").
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(device: str | torch.device = "cpu", flags: frozenset[str] | None = None) -> bool:
    """bf16 matmuls are at least as fast as fp32 here: a CUDA device that supports bf16, or a CPU with bf16
    instructions (`flags`: the CPU's, read from /proc/cpuinfo unless given)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    return any(flag in (cpu_flags() if flags is None else flags) for flag in NATIVE_BF16_CPU_FLAGS)


def torch_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """"bf16" / "bfloat16" / torch.bfloat16 -> torch.bfloat16; "auto" -> bf16 where it is native on `device`,
    else float32. An unknown name is a KeyError naming the known ones."""
    if isinstance(name, torch.dtype):
        return name
    if str(name) == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    try:
        return TORCH_DTYPES[str(name)]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r} (expected 'auto' or one of {sorted(TORCH_DTYPES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the engines' and transformers' spelling (configs write "bf16")."""
    return str(dtype).removeprefix("torch.")


def config_dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bf16": the configs' spelling."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
