"""Export size, FP8 vs bf16: bytes and ratio (goal <= 0.55x), printed as one JSON line.

    python bench/bench_export.py [--skip-kimi] [--workdir DIR]

Measured (real random drafters, real exports through scripts/export.py):
  testbed: the SmolLM2-135M target's shape (hidden 576, intermediate 1536), 2 draft layers, 5 target layers;
  kimi_1_layer: a Kimi-K2-shaped target (DeepSeek-V3 architecture, hidden 7168, intermediate 18432, 64 heads,
    61 layers, vocab 163,840), 1 draft layer, 5 target layers (~0.86 B draft parameters; about a minute here).
Projected (exact tensor byte counts from the contract's expected shapes, nothing allocated): the 5-layer Kimi
drafter of configs/kimi-k2.6.yaml, the same with 8 KV heads, and a DeepSeek-V3-shaped 5-layer drafter.

q/k/v and the norms stay bf16 (SGLang's DFlash slices the raw fused qkv weight), so
  ratio = 1/2 + (bf16 share of the parameters) / 2   (plus the small float32 scales and the file header).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


import torch

from configs.schema import DrafterConfig
from drafters.export import contract, fp8
from drafters.drafter.checkpoint import config_dict, save_drafter
from drafters.drafter.config import build_draft_config
from drafters.drafter.model import DFlashDrafter
from drafters.export import exporter as export

GOAL = 0.55
MASK = 16


def smollm2_config():
    try:
        from transformers import AutoConfig

        from drafters.target.testbed import prepare_testbed_target

        return AutoConfig.from_pretrained(prepare_testbed_target()), "testbed target folder"
    except RuntimeError:  # testbed packages missing: the same widths by hand
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64), "SmolLM2 widths"


def kimi_config(**overrides):
    from transformers import DeepseekV3Config

    # Kimi K2: DeepSeek-V3 layout with 64 attention heads and a 163,840-token vocabulary.
    fields = dict(vocab_size=163_840, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                  num_attention_heads=64, num_key_value_heads=64)
    return DeepseekV3Config(**{**fields, **overrides})


def payload(cfg: dict, fmt: str) -> int:
    """Exact tensor bytes of an export (without the safetensors header)."""
    total = 0
    for shape, dtype in contract.expected_tensors(cfg, fmt).values():
        total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return total


def bf16_share(cfg: dict) -> float:
    params = {n: torch.Size(s).numel() for n, (s, _) in contract.expected_tensors(cfg, "source").items()}
    return sum(v for n, v in params.items() if not fp8.is_quantized_weight(n)) / sum(params.values())


def measure(name: str, target_config, drafter_cfg: DrafterConfig, workdir: Path, build_dtype=torch.float32) -> dict:
    config = build_draft_config(drafter_cfg, target_config, MASK)
    started = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(build_dtype)  # bf16 for the big shape: half the memory and I/O of fp32
    try:
        torch.manual_seed(0)
        drafter = DFlashDrafter(config)
    finally:
        torch.set_default_dtype(previous)
    src = save_drafter(drafter, workdir / f"{name}-src")
    params = sum(p.numel() for p in drafter.parameters())
    del drafter
    build_s = time.perf_counter() - started
    result = {"params": params, "source_dtype": str(build_dtype).removeprefix("torch."), "build_s": round(build_s, 1)}
    for dtype in ("fp8", "bf16"):
        started = time.perf_counter()
        summary = export.export_drafter(src, workdir / f"{name}-{dtype}", dtype, allow_unaligned=True)
        result[f"{dtype}_bytes"] = summary["weights_bytes"]
        result[f"{dtype}_export_s"] = round(time.perf_counter() - started, 1)
        if dtype == "fp8":
            result["sglang_fp8_servable"] = not summary["fp8_alignment_problems"]
        shutil.rmtree(workdir / f"{name}-{dtype}")
    cfg = json.loads((src / "config.json").read_text())
    shutil.rmtree(src)
    result["ratio"] = round(result["fp8_bytes"] / result["bf16_bytes"], 4)
    result["bf16_param_share"] = round(bf16_share(cfg), 4)
    result["shape"] = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "head_dim")}
    result["num_target_features"] = len(cfg["dflash_config"]["target_layer_ids"])
    return result


def project(name: str, target_config, drafter_cfg: DrafterConfig) -> dict:
    cfg = config_dict(build_draft_config(drafter_cfg, target_config, MASK))
    fp8_b, bf16_b = payload(cfg, "fp8"), payload(cfg, "bf16")
    return {"name": name, "fp8_bytes": fp8_b, "bf16_bytes": bf16_b, "ratio": round(fp8_b / bf16_b, 4),
            "bf16_param_share": round(bf16_share(cfg), 4), "num_hidden_layers": cfg["num_hidden_layers"],
            "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
            "sglang_fp8_servable": not contract.fp8_alignment_problems(cfg)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-kimi", action="store_true", help="skip the measured 1-layer Kimi-shaped export")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench_export.", dir=args.workdir))
    try:
        smol, smol_source = smollm2_config()
        result = {"bench": "export_size", "goal_ratio": GOAL,
                  "testbed": {"target": f"SmolLM2-135M ({smol_source})",
                              **measure("testbed", smol, DrafterConfig(num_layers=2, num_target_features=5), workdir)}}
        if not args.skip_kimi:
            result["kimi_1_layer"] = {"target": "Kimi-K2-shaped (DeepseekV3Config)",
                                      **measure("kimi", kimi_config(), DrafterConfig(num_layers=1, num_target_features=5),
                                                workdir, build_dtype=torch.bfloat16)}
        result["projected"] = [
            project("kimi 5 layers (configs/kimi-k2.6.yaml)", kimi_config(), DrafterConfig(num_layers=5)),
            project("kimi 5 layers, 8 KV heads", kimi_config(), DrafterConfig(num_layers=5, num_key_value_heads=8)),
            project("deepseek-v3 5 layers", kimi_config(num_attention_heads=128, num_key_value_heads=128, vocab_size=129_280),
                    DrafterConfig(num_layers=5)),
        ]
        for entry in (result["testbed"], result.get("kimi_1_layer"), *result["projected"]):
            if entry:
                entry["meets_goal"] = entry["ratio"] <= GOAL
        print(json.dumps(result))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
