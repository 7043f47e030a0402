"""The serving contract of a drafter folder, checked before an export writes anything.

What SGLang's DFlash model (`python/sglang/srt/models/dflash.py`), vLLM's `qwen3_dflash.py` and the z-lab
reference package load: config.json with the Qwen3 fields, "architectures": ["DFlashDraftModel"],
"num_target_layers", "block_size" and "dflash_config" {"mask_token_id", "target_layer_ids"}, and
model.safetensors holding exactly the draft weights (no embed_tokens, no lm_head: both come from the
target). SGLang's loader silently skips names it does not know, so a misnamed or missing tensor would
serve uninitialised memory; hence the exact name/shape/dtype check here.

Formats:
  "source"  a training-side folder: any floating dtype, no quantization_config, finite values;
  "bf16"    every tensor bfloat16;
  (both export formats: no remote-code settings, `auto_map` or `trust_remote_code`, and no .py files)
  "fp8"     block FP8 (drafters.export.fp8): o_proj / MLP / fc weights float8_e4m3fn with float32
            weight_scale_inv [ceil(out/128), ceil(in/128)], everything else bfloat16, and the exact
            quantization_config of drafters.export.fp8.quantization_config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file

from drafters.export import fp8

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMATS = ("source", "bf16", "fp8")
INT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "num_target_layers", "block_size")
REQUIRED_KEYS = ("architectures", "model_type", *INT_KEYS, "rms_norm_eps", "dflash_config")
FORBIDDEN_PARTS = ("embed_tokens", "lm_head")
# Settings that make a loader run Python from the folder: an engine started with --trust-remote-code for its
# target would run the drafter folder's code too. A served drafter is plain Qwen3 layers and needs none.
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code", "custom_pipelines")
TP_CANDIDATES = (1, 2, 4, 8, 16)


class ContractError(ValueError):
    """A drafter folder or state dict that SGLang / vLLM / the reference package would not load correctly."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("drafter contract violated:\n  - " + "\n  - ".join(self.problems))


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ContractError(problems)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------

def remote_code_problems(cfg: Mapping) -> list[str]:
    return [f"config.json: {key} {cfg[key]!r} asks the loader to run Python from the folder; a drafter export "
            "needs no remote code" for key in REMOTE_CODE_KEYS if key in cfg and cfg[key] not in (None, False)]


def config_problems(cfg: Mapping, fmt: str) -> list[str]:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    problems = [f"config.json: missing key {key!r}" for key in REQUIRED_KEYS if key not in cfg]
    if problems:
        return problems
    if "DFlashDraftModel" not in (cfg["architectures"] or []):
        problems.append(f"config.json: architectures {cfg['architectures']!r} must be ['DFlashDraftModel']")
    if cfg["model_type"] != "qwen3":
        problems.append(f"config.json: model_type {cfg['model_type']!r} must be 'qwen3'")
    for key in INT_KEYS:
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"config.json: {key} must be a positive integer, got {value!r}")
    if problems:
        return problems
    if cfg["block_size"] < 2:
        problems.append(f"config.json: block_size {cfg['block_size']} must be >= 2")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        problems.append(f"config.json: num_attention_heads {cfg['num_attention_heads']} is not a multiple of "
                        f"num_key_value_heads {cfg['num_key_value_heads']}")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"config.json: hidden_act {cfg['hidden_act']!r}: SGLang's DFlash MLP supports only 'silu'")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (len(layer_types) != cfg["num_hidden_layers"]
                                    or any(t != "full_attention" for t in layer_types)):
        problems.append(f"config.json: layer_types {layer_types!r} must be 'full_attention' for each of the "
                        f"{cfg['num_hidden_layers']} layers (sliding layers are served causally)")

    extra = cfg["dflash_config"]
    if not isinstance(extra, Mapping):
        return problems + [f"config.json: dflash_config must be an object, got {extra!r}"]
    mask = extra.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < cfg["vocab_size"]:
        problems.append(f"config.json: dflash_config.mask_token_id {mask!r} must be an integer in "
                        f"[0, vocab_size {cfg['vocab_size']})")
    ids = extra.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.append(f"config.json: dflash_config.target_layer_ids must be a non-empty list of integers, got {ids!r}")
    else:
        bad = [i for i in ids if not 0 <= i < cfg["num_target_layers"]]
        if bad:
            problems.append(f"config.json: dflash_config.target_layer_ids {bad} out of range for "
                            f"num_target_layers {cfg['num_target_layers']}")
    if "block_size" in extra and extra["block_size"] != cfg["block_size"]:
        problems.append(f"config.json: dflash_config.block_size {extra['block_size']} != block_size {cfg['block_size']}")

    quant = cfg.get("quantization_config")
    if fmt == "fp8":
        expected = fp8.quantization_config(cfg["num_hidden_layers"], cfg["num_target_layers"])
        if quant != expected:
            problems.append(f"config.json: quantization_config {quant!r} != expected {expected!r}")
    elif quant is not None:
        problems.append(f"config.json: unexpected quantization_config {quant!r} in a {fmt} folder"
                        + (" (export from the bf16/fp32 training checkpoint, not from an FP8 export)" if fmt == "source" else ""))
    if fmt in ("bf16", "fp8"):
        problems += remote_code_problems(cfg)
        for key in ("dtype", "torch_dtype"):
            if cfg.get(key) != "bfloat16":
                problems.append(f"config.json: {key} {cfg.get(key)!r} must be 'bfloat16'")
    return problems


def check_config(cfg: Mapping, fmt: str) -> None:
    _raise_if(config_problems(cfg, fmt))


def fp8_alignment_problems(cfg: Mapping, block: tuple[int, int] = fp8.BLOCK) -> list[str]:
    """Shapes SGLang's block-FP8 linear cannot run (at any tensor-parallel size).

    Activations are quantized per token in groups of block_k along the input dim, which asserts
    in_features % 128 == 0 for every FP8 linear (o_proj: heads*head_dim, gate_up: hidden, down:
    intermediate, fc: K*hidden); the merged gate_up_proj needs each half (intermediate) % 128 == 0.
    """
    qo = cfg["num_attention_heads"] * cfg["head_dim"]
    checks = [("hidden_size", cfg["hidden_size"], "gate/up_proj and fc inputs"),
              ("intermediate_size", cfg["intermediate_size"], "down_proj input and the merged gate_up_proj halves"),
              ("num_attention_heads * head_dim", qo, "o_proj input")]
    return [f"{name} = {value} is not a multiple of {block[1]} ({what}); SGLang's block-FP8 kernels need it"
            for name, value, what in checks if value % block[1]]


def fp8_tp_sizes(cfg: Mapping, block: tuple[int, int] = fp8.BLOCK) -> list[int]:
    """Tensor-parallel sizes at which every FP8 partition stays 128-aligned (SGLang/vLLM create_weights)."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    qo, inter = heads * cfg["head_dim"], cfg["intermediate_size"]
    good = []
    for tp in TP_CANDIDATES:
        if heads % tp or (kv % tp if kv >= tp else tp % kv) or qo % tp or inter % tp:
            continue
        if (qo // tp) % block[1] or (inter // tp) % block[0] or cfg["hidden_size"] % block[1]:
            continue
        good.append(tp)
    return good


# ---------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------

def expected_tensors(cfg: Mapping, fmt: str) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """name -> (shape, dtype) of every tensor a folder of this format must hold (dtype None: any float)."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    k = len(cfg["dflash_config"]["target_layer_ids"])
    bias = bool(cfg.get("attention_bias", False))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, out_f in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes[f"{p}self_attn.{name}.weight"] = (out_f, h)
            if bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out_f,)
        shapes[f"{p}self_attn.o_proj.weight"] = (h, q_out)
        if bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (h,)
        shapes[f"{p}self_attn.q_norm.weight"] = (d,)
        shapes[f"{p}self_attn.k_norm.weight"] = (d,)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, inter)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    shapes["fc.weight"] = (h, k * h)
    shapes["hidden_norm.weight"] = (h,)
    shapes["norm.weight"] = (h,)

    if fmt == "source":
        return {name: (shape, None) for name, shape in shapes.items()}
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for name, shape in shapes.items():
        if fmt == "fp8" and fp8.is_quantized_weight(name):
            out[name] = (shape, fp8.FP8_DTYPE)
            out[fp8.scale_name(name)] = (fp8.scale_shape(shape), torch.float32)
        else:
            out[name] = (shape, torch.bfloat16)
    return out


def tensor_problems(tensors: Mapping[str, torch.Tensor], cfg: Mapping, fmt: str) -> list[str]:
    expected = expected_tensors(cfg, fmt)
    problems = []
    for name in sorted(set(tensors) - set(expected)):
        if any(part in name for part in FORBIDDEN_PARTS):
            problems.append(f"tensor {name}: a drafter must not ship the target's embed_tokens / lm_head")
        else:
            problems.append(f"tensor {name}: unexpected (not a DFlash draft weight)")
    for name in sorted(set(expected) - set(tensors)):
        problems.append(f"tensor {name}: missing (expected shape {list(expected[name][0])})")
    for name, (shape, dtype) in expected.items():
        t = tensors.get(name)
        if t is None:
            continue
        if tuple(t.shape) != shape:
            problems.append(f"tensor {name}: shape {list(t.shape)} != expected {list(shape)}")
            continue
        if dtype is None:
            if not t.is_floating_point() or t.dtype == fp8.FP8_DTYPE:
                problems.append(f"tensor {name}: dtype {t.dtype} is not a training float dtype")
                continue
        elif t.dtype != dtype:
            problems.append(f"tensor {name}: dtype {t.dtype} != expected {dtype}")
            continue
        values = t.float() if t.dtype == fp8.FP8_DTYPE else t
        if torch.isnan(values).any():
            problems.append(f"tensor {name}: contains NaN")
        elif torch.isinf(values).any():
            problems.append(f"tensor {name}: contains Inf")
        elif name.endswith("." + fp8.SCALE_SUFFIX) and not bool((values > 0).all()):
            problems.append(f"tensor {name}: block scales must be > 0")
    return problems


def check_tensors(tensors: Mapping[str, torch.Tensor], cfg: Mapping, fmt: str) -> None:
    _raise_if(tensor_problems(tensors, cfg, fmt))


# ---------------------------------------------------------------------------------------------
# folders
# ---------------------------------------------------------------------------------------------

def folder_format(cfg: Mapping) -> str:
    quant = cfg.get("quantization_config")
    if quant is not None:
        return "fp8"
    return "bf16" if cfg.get("dtype") == cfg.get("torch_dtype") == "bfloat16" else "source"


def check_folder(path: str | Path, fmt: str | None = None) -> dict:
    """Check a drafter folder on disk; return {"format", "tensors", "bytes"}. fmt None: from config.json."""
    path = Path(path)
    problems = [f"{path}: missing {name}" for name in (CONFIG_NAME, WEIGHTS_NAME) if not (path / name).is_file()]
    _raise_if(problems)
    cfg = json.loads((path / CONFIG_NAME).read_text())
    fmt = fmt or folder_format(cfg)
    if fmt != "source":
        _raise_if([f"{path}: holds Python file {p.name}; a drafter export ships no code" for p in sorted(path.glob("*.py"))])
    check_config(cfg, fmt)
    tensors = load_file(str(path / WEIGHTS_NAME), device="cpu")
    check_tensors(tensors, cfg, fmt)
    return {"format": fmt, "tensors": len(tensors),
            "bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file())}
