"""The serving engine against our in-process paths on this CPU, side by side in one run (one JSON line):

    python -m bench.bench_engine [--prompts 16] [--max-new-tokens 64] [--parts serve,regenerate,capture]
                                 [--drafter DIR] [--dtype auto]

serve       vLLM serving the target alone vs the target + a DFlash drafter (eval/engine.py, batch 1,
            greedy): tokens/s end to end and tau from the engine's counters. The pairs: the testbed target
            SmolLM2-135M with an untrained drafter (tau 1: the drafter's pure overhead), with a trained one
            (--drafter: a drafter folder, checkpoint or output_dir), and the engine testbed's tiny Llama with
            its trained drafter (eval/engine_testbed.py, tau ~7: the best case).
--dtype     the SmolLM2 target's dtype in every part, for both sides ("auto": bf16 only where the hardware
            multiplies it natively, common/dtypes.py).
regenerate  data.regeneration.regenerate.regenerate on the same chat prompts with backend hf (transformers generate,
            batch 16) and vllm: response tokens per second of generation (engine start-up reported apart).
capture     write_feature_cache of the same rows (chat prompts + their regenerated answers) through
            forward hooks (HFCapture, bf16) and through vLLM's extract_hidden_states (EngineCapture):
            captured tokens per second (engine start-up reported apart).
Each engine runs in this process, started and shut down in turn (spawned engine processes: __main__ guard).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def serve_pair(target: Path, drafter: Path, traces, max_new_tokens: int, stop_ids: list[int], dtype: str) -> dict:
    from engines.vllm.engine import InProcessEngine, run_traces, summarize_runs

    out = {}
    for name, folder in (("target", None), ("target+drafter", drafter)):
        started = time.perf_counter()
        kwargs = {}
        with InProcessEngine(target, folder, dtype=dtype, **kwargs) as engine:
            startup = time.perf_counter() - started
            runs = run_traces(engine, traces, max_new_tokens, stop_ids, 0.0, 0, log=lambda *a: None)
            summary = summarize_runs([r for rs in runs.values() for r in rs], engine.backend)
        out[name] = {**summary, "startup_seconds": startup}
    base, spec = out["target"]["tokens_per_s_e2e"], out["target+drafter"]["tokens_per_s_e2e"]
    out["speedup_e2e"] = spec / base if base and spec else None
    return out


def part_serve(args, tmp: Path) -> dict:
    import torch
    from transformers import AutoConfig

    from eval import engine_testbed
    from configs.schema import DrafterConfig
    from drafters.target.chat import load_tokenizer
    from engines.hf.generation import stop_token_ids
    from drafters.drafter.checkpoint import save_drafter
    from drafters.drafter.config import build_draft_config
    from drafters.drafter.model import DFlashDrafter
    from eval.traces import agentic_traces, heldout_traces
    from drafters.target.testbed import prepare_testbed_target

    smol = prepare_testbed_target()
    torch.manual_seed(0)
    untrained = save_drafter(DFlashDrafter(build_draft_config(DrafterConfig(num_layers=1, block_size=16),
                                                              AutoConfig.from_pretrained(smol), 16)), tmp / "untrained")
    tokenizer = load_tokenizer(smol)
    stop_ids = stop_token_ids(smol, tokenizer)
    traces = {"code": heldout_traces("code", tokenizer, max_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                                     seed=0)}
    result = {"smollm2_untrained_drafter": serve_pair(smol, Path(untrained), traces, args.max_new_tokens, stop_ids,
                                                      args.dtype)}
    if args.drafter:
        from drafters.drafter.checkpoint import find_drafter_folder

        result["smollm2_trained_drafter"] = serve_pair(smol, find_drafter_folder(args.drafter), traces,
                                                       args.max_new_tokens, stop_ids, args.dtype)
    tiny = engine_testbed.build(tmp / "tiny")
    tiny_traces = {"agentic": agentic_traces([str(tiny["log"])], engine_testbed.VOCAB, max_prompts=3,
                                             max_new_tokens=engine_testbed.NEW, quarantine_path=tmp / "q.jsonl")}
    result["tiny_llama_trained_drafter"] = serve_pair(tiny["target"], tiny["drafter"], tiny_traces,
                                                      engine_testbed.NEW, [2], "float32")
    return result


def bench_prompts(n: int) -> list[dict]:
    from bench.bench_regenerate import bench_prompts as prompts

    return prompts(n)


def part_regenerate(args, tmp: Path) -> dict:
    from common.dtypes import config_dtype_name, torch_dtype
    from data.regeneration.regenerate import regenerate
    from drafters.target.testbed import prepare_testbed_target

    target = prepare_testbed_target()
    out = {}
    for backend in ("hf", "vllm"):
        started = time.perf_counter()
        dataset = regenerate(bench_prompts(args.prompts), target, tmp / f"regen-{backend}", batch_size=16,
                             max_new_tokens=args.max_new_tokens, backend=backend, progress=False,
                             dtype=config_dtype_name(torch_dtype(args.dtype)))
        wall = time.perf_counter() - started
        summary = json.loads((tmp / f"regen-{backend}" / "summary.json").read_text()) \
            if (tmp / f"regen-{backend}" / "summary.json").exists() else {}
        tokens = sum(sum(m) for m in dataset["loss_mask"])
        out[backend] = {"response_tokens": int(tokens), "wall_seconds": wall, "summary": summary}
        if backend == "hf":
            out["rows"] = [list(r) for r in dataset["input_ids"]]
    return out


def part_capture(args, tmp: Path, regenerated: list[list[int]] | None) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from engines.vllm.capture import EngineCapture
    from data.feature_cache import write_feature_cache
    from drafters.target.capture import HFCapture
    from drafters.target.testbed import prepare_testbed_target

    target = prepare_testbed_target()
    layer_ids = [1, 8, 14, 20, 27]
    if regenerated:
        rows = [{"input_ids": r} for r in regenerated]
    else:
        from drafters.target.chat import load_tokenizer

        tok = load_tokenizer(target)
        rows = [{"input_ids": tok.apply_chat_template(p["messages"], tokenize=True, return_dict=False)}
                for p in bench_prompts(args.prompts)]
    dataset = Dataset.from_list(rows)
    tokens = sum(len(r["input_ids"]) for r in rows)
    out = {"rows": len(rows), "tokens": tokens}
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, args.dtype)).eval()
    hooks = HFCapture(model, layer_ids)
    started = time.perf_counter()
    write_feature_cache(dataset, hooks, tmp / "cache-hooks", progress=False)
    out["hooks"] = {"seconds": time.perf_counter() - started}
    hooks.remove()
    del model, hooks
    started = time.perf_counter()
    engine = EngineCapture(target, layer_ids, dtype=args.dtype)
    startup = time.perf_counter() - started
    started = time.perf_counter()
    write_feature_cache(dataset, engine, tmp / "cache-engine", progress=False, batch_size=64)
    out["engine"] = {"seconds": time.perf_counter() - started, "startup_seconds": startup, "backend": engine.backend}
    engine.close()
    for name in ("hooks", "engine"):
        out[name]["tokens_per_s"] = tokens / out[name]["seconds"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--parts", default="serve,regenerate,capture")
    parser.add_argument("--drafter", default=None, help="a trained SmolLM2 drafter to serve as well")
    parser.add_argument("--dtype", default="auto", help="the SmolLM2 target's dtype (auto, bf16, fp32)")
    args = parser.parse_args(argv)
    import torch

    from common.dtypes import dtype_name, torch_dtype

    args.dtype = dtype_name(torch_dtype(args.dtype))
    parts = args.parts.split(",")
    result = {"bench": "engine", "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
              "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "load_average_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        rows = None
        if "serve" in parts:
            result["serve"] = part_serve(args, tmp)
            print(json.dumps({"part": "serve", **result["serve"]}, default=str), flush=True)
        if "regenerate" in parts:
            result["regenerate"] = part_regenerate(args, tmp)
            rows = result["regenerate"].pop("rows")
            print(json.dumps({"part": "regenerate", **result["regenerate"]}, default=str), flush=True)
        if "capture" in parts:
            result["capture"] = part_capture(args, tmp, rows)
    result["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
