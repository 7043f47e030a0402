"""Export a trained drafter to a folder SGLang (DFLASH), vLLM (dflash) and the z-lab reference package load.

    dflash-pipeline export CKPT OUT --dtype fp8|bf16 [--model-card-info JSON] [--overwrite]

CKPT: a reference-format drafter folder (config.json + model.safetensors), a training checkpoint
folder holding one under drafter/, or a training output_dir (its newest checkpoint); the rule is
drafters.drafter.checkpoint.find_drafter_folder. OUT: the new folder, written atomically
(built under a temporary name next to OUT, checked on disk, then moved into place with os.replace).

--dtype bf16: every tensor bfloat16.
--dtype fp8:  DeepSeek-style block FP8 (drafters/export/fp8.py) for o_proj, the MLP and fc; q/k/v and the norms
              stay bfloat16. config.json gets the quantization_config SGLang's Fp8Config parses.

Before anything is written the source is checked (drafters/export/contract.py): required config keys, every
draft tensor present with the right shape, no embed_tokens / lm_head, no NaN / Inf; a failure names the
tensor and nothing is written. The produced config and tensors are checked again, in memory and then
from the files, before the folder is moved into place.

--model-card-info: inline JSON or a path to a JSON file, e.g.
    {"target": "moonshotai/Kimi-K2-Instruct", "data": "regenerated chat + agent trajectories, 1.2M samples",
     "tau": {"code": 5.84, "prose": 3.1}, "with_lookup": {"code": 6.1, "prose": 3.0}, "prompt_lookup": {...}}
It fills README.md inside the export (target, data summary, tau table, launch commands). With "with_lookup" (the
drafter with prompt lookup) or "prompt_lookup" taus the table says which of the three to serve per category.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.atomic_files import atomic_folder, make_readable
from drafters.decoding.proposers import COMBINATION_SERVING
from drafters.drafter.checkpoint import find_drafter_folder
from drafters.export import contract, fp8
from drafters.export.contract import CONFIG_NAME, WEIGHTS_NAME, ContractError

README_NAME = "README.md"
EXPORT_DTYPES = ("fp8", "bf16")  # serving formats
# Model card taus: the drafter alone, the drafter with prompt lookup, prompt lookup alone.
TAU_KEYS = {"tau": "drafter", "with_lookup": "drafter with lookup", "prompt_lookup": "prompt lookup"}


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

def read_model_card_info(value: str | dict | None) -> dict:
    if value is None:
        return {}
    if isinstance(value, dict):
        info = value
    else:
        text = Path(value).read_text() if not value.lstrip().startswith("{") and Path(value).is_file() else value
        try:
            info = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--model-card-info is neither a JSON object nor a JSON file: {e}") from None
    if not isinstance(info, dict):
        raise ValueError(f"--model-card-info must be a JSON object, got {type(info).__name__}")
    for key in TAU_KEYS:
        tau = info.get(key, {})
        if not isinstance(tau, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                for v in tau.values()):
            raise ValueError(f"--model-card-info: {key} must map category -> number, got {tau!r}")
    return info


def export_config(src_cfg: dict, dtype: str) -> dict:
    cfg = copy.deepcopy(src_cfg)
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["dtype"] = "bfloat16"
    cfg["torch_dtype"] = "bfloat16"  # transformers 4.x / older SGLang and vLLM readers
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope, dict) and "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    cfg.pop("quantization_config", None)
    for key in contract.REMOTE_CODE_KEYS:  # the export is standard Qwen3 layers: no loader runs code for it
        cfg.pop(key, None)
    if dtype == "fp8":
        cfg["quantization_config"] = fp8.quantization_config(cfg["num_hidden_layers"], cfg["num_target_layers"])
    return cfg


def export_tensors(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    if dtype == "fp8":
        return fp8.quantize_state_dict(state)
    return {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in state.items()}


# ---------------------------------------------------------------------------------------------
# model card
# ---------------------------------------------------------------------------------------------

def sglang_command(target: str, out: str, cfg: dict) -> str:
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {cfg['block_size']}")


def vllm_command(target: str, out: str, cfg: dict) -> str:
    spec = json.dumps({"method": "dflash", "model": out, "num_speculative_tokens": cfg["block_size"] - 1})
    return f"vllm serve {target} --speculative-config '{spec}'"


def attention_row(extra: dict) -> str:
    if not extra.get("use_swa"):
        return "full"
    return (f"sliding window of {extra['swa_window_size']} positions (`dflash_config.use_swa`: vLLM serves it; SGLang "
            "and the z-lab reference read a window from `layer_types` only and serve full attention, the same drafter "
            f"up to {extra['swa_window_size']} positions of context)")


def tau_table(info: dict) -> list[str]:
    """The drafter's tau per category; with the other methods' taus, which of them to serve."""
    given = {key: info[key] for key in TAU_KEYS if info.get(key)}
    if not given:
        return ["Not measured.", ""]
    if list(given) == ["tau"]:
        return ["| category | tau |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in given["tau"].items()] + [""]
    categories = list(dict.fromkeys(c for taus in given.values() for c in taus))
    lines = ["| category | " + " | ".join(TAU_KEYS[k] for k in given) + " | serve |", "|---|" + "---|" * (len(given) + 1)]
    for c in categories:
        taus = {k: given[k].get(c) for k in given}
        # Cheapest first, so a tie goes to the method with the fewest drafter passes.
        best = max((k for k in ("prompt_lookup", "tau", "with_lookup") if taus.get(k) is not None), key=lambda k: taus[k])
        cells = " | ".join("" if v is None else f"{v:.2f}" for v in taus.values())
        lines.append(f"| {c} | {cells} | {TAU_KEYS[best]} |")
    return lines + ["", "The drafter with lookup takes prompt lookup's draft where the context's last tokens recur "
                    "earlier (of several earlier occurrences, the one whose continuation the drafter's draft agrees "
                    "with), the drafter's otherwise. " + COMBINATION_SERVING, ""]


def model_card(cfg: dict, dtype: str, out: str, info: dict, sizes: dict) -> str:
    target = str(info.get("target") or "TARGET")
    extra = cfg["dflash_config"]
    lines = [f"# DFlash drafter for {target}", ""]
    lines += ["A block speculative-decoding drafter (DFlash): it reads the target's hidden states from "
              f"{len(extra['target_layer_ids'])} layers and drafts {cfg['block_size'] - 1} tokens per step in one "
              "forward pass; the target verifies them, so the output is exactly the target's.", ""]
    lines += ["| field | value |", "|---|---|",
              f"| target | {target} |",
              f"| weights | {'block FP8 (float8_e4m3fn, 128x128 blocks, float32 weight_scale_inv) for o_proj, MLP and fc; q/k/v and norms bf16' if dtype == 'fp8' else 'bfloat16'} |",
              f"| size | {sizes['weights_bytes']:,} bytes (model.safetensors) |",
              f"| draft layers | {cfg['num_hidden_layers']} (hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, "
              f"{cfg['num_attention_heads']} heads x {cfg['head_dim']}, {cfg['num_key_value_heads']} KV heads) |",
              f"| target layers read (`target_layer_ids`, output of 0-based layer i) | {extra['target_layer_ids']} of {cfg['num_target_layers']} |",
              f"| block size | {cfg['block_size']} |",
              f"| draft attention | {attention_row(extra)} |",
              f"| mask token id | {extra['mask_token_id']} |", ""]
    lines += ["## Data", "", str(info.get("data") or "Not provided."), ""]
    lines += ["## Acceptance length (tau, tokens per target verify step, bonus token included)", ""]
    lines += tau_table(info)
    others = {k: v for k, v in info.items() if k not in ("target", "data", *TAU_KEYS)}
    if others:
        lines += ["## Notes", ""] + [f"- {k}: {v}" for k, v in others.items()] + [""]
    lines += ["## Serve with SGLang", "", "```bash", sglang_command(target, out, cfg), "```", ""]
    if dtype == "fp8":
        tp = contract.fp8_tp_sizes(cfg)
        problems = contract.fp8_alignment_problems(cfg)
        lines += ["No extra flag is needed for FP8: SGLang builds the draft's quantization from this folder's "
                  "`quantization_config` (`--speculative-draft-model-quantization` defaults to auto-detection; "
                  "`--speculative-draft-model-quantization fp8` says the same explicitly). Needs an FP8-capable "
                  "GPU (SGLang's Fp8Config asks for compute capability >= 8.0). It also needs an SGLang whose "
                  "`python/sglang/srt/models/dflash.py` passes `quant_config` to o_proj, the MLP and fc (as commit "
                  "003b23d7 does); a version that builds the DFlash layers without a quant config skips the "
                  "`weight_scale_inv` tensors and loads the FP8 weights unscaled. Serve the bf16 export there.", ""]
        if problems:
            lines += ["**Warning: this FP8 export cannot run on SGLang's block-FP8 kernels:**", ""]
            lines += [f"- {p}" for p in problems] + ["", "Serve the bf16 export instead.", ""]
        else:
            lines += [f"Tensor-parallel sizes at which every FP8 partition stays 128-aligned: {tp}.", ""]
    lines += ["## Serve with vLLM", "", "```bash", vllm_command(target, out, cfg), "```", ""]
    if dtype == "bf16":
        lines += ["## Load with the reference package (z-lab `dflash`)", "", "```python",
                  "from dflash.model import DFlashDraftModel", f"draft = DFlashDraftModel.from_pretrained({out!r})", "```", ""]
    else:
        lines += ["## Load in PyTorch", "", "```python", "from drafters.export.fp8 import load_fp8_drafter",
                  f"drafter = load_fp8_drafter({out!r})  # dequantized on the CPU", "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------

def export_drafter(ckpt: str | Path, out: str | Path, dtype: str = "fp8", model_card_info=None,
                   overwrite: bool = False, allow_unaligned: bool = False, allow_remote_code_source: bool = False) -> dict:
    """Check, convert and atomically write an export. Returns a summary dict. Raises ContractError.

    A source whose config.json asks for remote code (auto_map, trust_remote_code) is refused unless
    allow_remote_code_source; the export never carries those settings either way."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    src = find_drafter_folder(ckpt)
    out = Path(out)
    info = read_model_card_info(model_card_info)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
        if not (out / CONFIG_NAME).is_file():
            raise FileExistsError(f"{out} exists and holds no {CONFIG_NAME}; refusing to replace a folder that is not a drafter export")
    resolved_out, resolved_src = out.resolve(), src.resolve()
    if resolved_out == resolved_src or resolved_out in resolved_src.parents:
        raise ValueError(f"{out} would replace the source checkpoint {src}")

    # 1. The source, before anything is written.
    src_cfg = json.loads((src / CONFIG_NAME).read_text())
    contract.check_config(src_cfg, "source")
    remote = contract.remote_code_problems(src_cfg)
    if remote and not allow_remote_code_source:
        raise ContractError(remote + ["this pipeline's drafters need no remote code; pass --allow-remote-code-source to "
                                      "export it anyway (the export drops these settings)"])
    state = load_file(str(src / WEIGHTS_NAME), device="cpu")
    contract.check_tensors(state, src_cfg, "source")
    if dtype == "fp8" and not allow_unaligned:
        problems = contract.fp8_alignment_problems(src_cfg)
        if problems:
            raise ContractError(problems + ["export with --dtype bf16, or pass --allow-unaligned to write the FP8 "
                                            "folder anyway (it will not run on SGLang's block-FP8 kernels)"])

    # 2. Convert and check in memory.
    cfg = export_config(src_cfg, dtype)
    tensors = export_tensors(state, dtype)
    del state
    contract.check_config(cfg, dtype)
    contract.check_tensors(tensors, cfg, dtype)

    # 3. Write next to OUT, check the files, move into place.
    with atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        del tensors
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        sizes = {"weights_bytes": (tmp / WEIGHTS_NAME).stat().st_size}
        (tmp / README_NAME).write_text(model_card(cfg, dtype, str(out), info, sizes))
        checked = contract.check_folder(tmp, dtype)
        make_readable(tmp)  # a serving process under another user must be able to read it
    return {"source": str(src), "out": str(out), "dtype": dtype, "tensors": checked["tensors"],
            "weights_bytes": sizes["weights_bytes"], "folder_bytes": checked["bytes"],
            "fp8_alignment_problems": contract.fp8_alignment_problems(cfg) if dtype == "fp8" else []}
