"""The config's one engine setting block (`target:`), turned into each engine's own arguments.

Regeneration (data/regeneration/regenerate.py), engine capture (engines/vllm/capture.py) and the eval's in-process engine
(eval/engine.py) all start their engine from here, so that parallelism, context length, memory share,
dtype, quantization and remote code are set once, in the config, and mean the same everywhere.

| setting | vLLM `LLM(...)` | SGLang `Engine(...)` | hf |
|---|---|---|---|
| tensor_parallel | tensor_parallel_size | tp_size | (device_map) |
| pipeline_parallel | pipeline_parallel_size | pp_size | (device_map) |
| expert_parallel | enable_expert_parallel | ep_size = tp_size | - |
| max_model_len | max_model_len | context_length | - |
| memory_share | gpu_memory_utilization | mem_fraction_static | - |
| dtype | dtype | dtype | dtype |
| quantization | quantization | quantization | - |
| trust_remote_code | trust_remote_code | trust_remote_code | trust_remote_code |
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.dtypes import dtype_name, torch_dtype
from configs.schema import TargetConfig

GPU_MEMORY_SHARE = 0.85
CPU_MEMORY_SHARE = 0.3  # vLLM's CPU build: the share of host memory its KV cache may take


class EngineSettingsError(ValueError):
    """Settings that cannot serve the job (too short a context, say); the message names the key."""


def memory_share(target: TargetConfig) -> float:
    if target.memory_share is not None:
        return target.memory_share
    return GPU_MEMORY_SHARE if torch.cuda.is_available() else CPU_MEMORY_SHARE


def context_length(target: TargetConfig, needed: int, job: str) -> int:
    """target.max_model_len, or what the job needs; refuses a set length below that."""
    if target.max_model_len is None:
        return needed
    if target.max_model_len < needed:
        raise EngineSettingsError(f"target.max_model_len={target.max_model_len} is shorter than {job} needs ({needed} "
                                  "tokens); raise it or leave it unset")
    return target.max_model_len


def engine_dtype(target: TargetConfig) -> str:
    """The compute dtype's name (auto: bfloat16 where the hardware multiplies it, else float32)."""
    return dtype_name(torch_dtype(target.dtype, "cuda" if torch.cuda.is_available() else "cpu"))


def vllm_kwargs(target: TargetConfig, target_path: str | Path, *, max_model_len: int, seed: int = 0) -> dict:
    """Keyword arguments of `vllm.LLM` for this target."""
    kwargs = {"model": str(target_path), "dtype": engine_dtype(target), "max_model_len": max_model_len,
              "tensor_parallel_size": target.tensor_parallel, "pipeline_parallel_size": target.pipeline_parallel,
              "gpu_memory_utilization": memory_share(target), "trust_remote_code": target.trust_remote_code,
              "seed": seed}
    if target.expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if target.quantization:
        kwargs["quantization"] = target.quantization
    if not torch.cuda.is_available():
        kwargs["enforce_eager"] = True  # the CPU build compiles no graphs
    return kwargs


def sglang_kwargs(target: TargetConfig, target_path: str | Path, *, max_model_len: int, seed: int = 0) -> dict:
    """Keyword arguments of `sglang.Engine` (every one a ServerArgs field) for this target. Token ids in and
    out (skip_tokenizer_init): regeneration never round-trips text."""
    kwargs = {"model_path": str(target_path), "dtype": engine_dtype(target), "context_length": max_model_len,
              "tp_size": target.tensor_parallel, "pp_size": target.pipeline_parallel,
              "mem_fraction_static": memory_share(target), "trust_remote_code": target.trust_remote_code,
              "random_seed": seed, "skip_tokenizer_init": True}
    if target.expert_parallel:
        kwargs["ep_size"] = target.tensor_parallel  # SGLang's experts split over the tensor-parallel group
    if target.quantization:
        kwargs["quantization"] = target.quantization
    return kwargs
