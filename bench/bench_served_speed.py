"""Served speed in vLLM on this CPU: the target alone against the target + each drafter, at batch 1 and batch 8,
on held-out code prompts and held-out agent sessions, with the break-even tau. With a bf16 and an FP8 export of
the same drafter side by side, it is also the FP8 comparison: tau and outputs of both, against the target alone.

    python -m bench.bench_served_speed --drafter bf16=exports/qs-bf16 --drafter fp8=exports/qs-fp8 \
        --trajectories outputs/agentic-heldout --prompts 8 --max-new-tokens 64 --dtype bf16

Per engine (the target alone first, then each drafter; one engine at a time, started in this process):
- batch 1: the prompts one at a time (`engines.vllm.engine.run_traces`), end-to-end tokens/s (prefill included)
  and tau from the engine's own counters (1 + accepted / drafts);
- batch 8: the same prompts sent together, 8 at a time (`generate_batch`, continuous batching): new tokens over
  the wall time, and tau from the counters' change over the batch.
Every drafter's greedy output is compared, token for token, with the target alone's output in the same engine
at the same batch size. Break-even tau: the tau at which the drafter's verify-and-draft step pays for itself,
tau x (target alone tok/s) / (target + drafter tok/s); above it the drafter is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from transformers import AutoConfig

from drafters.drafter.checkpoint import find_drafter_folder
from drafters.target.chat import load_tokenizer
from drafters.target.testbed import prepare_testbed_target
from engines.hf.generation import stop_token_ids
from engines.vllm.engine import InProcessEngine, run_traces, summarize_runs
from eval.traces import agentic_traces, heldout_traces

BATCH = 8


def traces(args, tokenizer, vocab_size: int) -> dict:
    sets = {"code": heldout_traces("code", tokenizer, max_prompts=args.prompts, max_new_tokens=args.max_new_tokens)}
    if args.trajectories:
        sets["agentic"] = agentic_traces([args.trajectories], vocab_size, max_prompts=args.prompts,
                                         max_new_tokens=args.max_new_tokens)
    return sets


def batched(engine: InProcessEngine, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> dict:
    drafts0, accepted0 = engine.counters()
    outputs, seconds = [], 0.0
    for start in range(0, len(prompts), BATCH):
        started = time.perf_counter()
        outputs += engine.generate_batch(prompts[start: start + BATCH], max_new_tokens, stop_ids)
        seconds += time.perf_counter() - started
    drafts1, accepted1 = engine.counters()
    drafts, accepted = drafts1 - drafts0, accepted1 - accepted0
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "new_tokens": tokens, "seconds": seconds, "tokens_per_s_e2e": tokens / seconds,
            "tau": 1.0 + accepted / drafts if drafts else None}


def measure_engine(target: Path, drafter: Path | None, trace_sets: dict, args, stop_ids: list[int]) -> dict:
    started = time.perf_counter()
    with InProcessEngine(target, drafter, dtype=args.dtype, max_model_len=args.max_model_len,
                         memory_fraction=args.memory_share) as engine:
        result = {"startup_seconds": time.perf_counter() - started, "backend": engine.backend}
        one = run_traces(engine, trace_sets, args.max_new_tokens, stop_ids, 0.0, 0, log=lambda *a: None)
        for category, ts in trace_sets.items():
            summary = summarize_runs(one[category], engine.backend)
            result[category] = {
                "batch1": {**summary, "outputs": [r.tokens for r in one[category]]},
                "batch8": batched(engine, [t.input_ids for t in ts.traces], args.max_new_tokens, stop_ids)}
    return result


def compare(results: dict, categories: list[str]) -> dict:
    """Speedup, break-even tau and exactness of every drafter against the target alone."""
    base = results["target"]
    table = {}
    for name, r in results.items():
        if name == "target":
            continue
        for category in categories:
            for batch in ("batch1", "batch8"):
                ours, alone = r[category][batch], base[category][batch]
                speedup = ours["tokens_per_s_e2e"] / alone["tokens_per_s_e2e"]
                same = sum(a == b for a, b in zip(ours["outputs"], alone["outputs"]))
                table[f"{name}/{category}/{batch}"] = {
                    "tau": ours["tau"], "tokens_per_s": ours["tokens_per_s_e2e"],
                    "target_tokens_per_s": alone["tokens_per_s_e2e"], "speedup": speedup,
                    "break_even_tau": ours["tau"] / speedup if ours["tau"] else None,
                    "identical": same, "prompts": len(alone["outputs"])}
    return table


def markdown(table: dict, args) -> str:
    lines = [(f"vLLM CPU, target `{args.dtype}`, greedy, {args.prompts} prompts per category, {args.max_new_tokens} new "
             "tokens; tok/s end to end (prefill included)."), "",
             ("| drafter | traffic | batch | tau | target alone tok/s | + drafter tok/s | speedup | break-even tau | "
             "outputs equal to the target's |"), "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, row in table.items():
        name, category, batch = key.split("/")
        lines.append(f"| {name} | {category} | {batch[5:]} | {row['tau']:.2f} | {row['target_tokens_per_s']:.1f} | "
                     f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | {row['break_even_tau']:.2f} | "
                     f"{row['identical']}/{row['prompts']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", action="append", required=True, help="NAME=PATH (a drafter folder or export)")
    parser.add_argument("--trajectories", default=None, help="held-out agent sessions (dflash-pipeline simulate)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (vLLM's FP8 CPU kernels take bf16)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--memory-share", type=float, default=0.15)
    parser.add_argument("--out", default="outputs/bench/served_speed")
    args = parser.parse_args(argv)
    target = prepare_testbed_target()
    tokenizer = load_tokenizer(target)
    stop_ids = stop_token_ids(target, tokenizer)
    trace_sets = traces(args, tokenizer, AutoConfig.from_pretrained(target).vocab_size)
    drafters = dict(d.split("=", 1) for d in args.drafter)
    results = {"target": measure_engine(target, None, trace_sets, args, stop_ids)}
    for name, path in drafters.items():
        results[name] = measure_engine(target, find_drafter_folder(path), trace_sets, args, stop_ids)
    table = compare(results, list(trace_sets))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "load_average": os.getloadavg(), "table": table, "results": results}
    (out / "served_speed.json").write_text(json.dumps(record, indent=1))
    (out / "served_speed.md").write_text(markdown(table, args))
    print(markdown(table, args))
    return record


if __name__ == "__main__":
    main()
