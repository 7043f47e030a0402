"""Agent sessions simulated in process against the same sessions through a vLLM server, side by side in one run.

    python -m bench.bench_simulate --sessions 8 --seed 7 --threads 2 --out outputs/bench/simulate

The same simulator config and seed both ways (``dflash-pipeline simulate`` with and without ``--server-url``). In
process, the HF target prefills every request's whole conversation again; the engine keeps the shared prefixes in
its prefix cache and prefills only the new part, and batches the sessions continuously. Reports wall seconds,
generated tokens/s and logged tokens per wall second for each, the engine's start-up, and how many requests came
out with the same output ids (the engine's bf16 numerics may break a near-tie differently; a session that differs
once goes on differently from there).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common.atomic_files import write_text_atomic
from drafters.target.testbed import prepare_testbed_target
from engines.vllm.server import make_spec, start, stop, url_of
from simulator.simulate import SimConfig, simulate

ENGINE_FLAGS = ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--gpu-memory-utilization", "0.15"]


def row(name: str, summary: dict, extra: str = "") -> str:
    return (f"| {name} | {summary['main_sessions']} ({summary['sessions']}) | {summary['requests']} | "
            f"{summary['wall_seconds']:.1f} | {summary['wall_seconds'] / summary['main_sessions']:.1f} | "
            f"{summary['generated_tokens_per_second']:.1f} | {summary['logged_tokens_per_wall_second']:.0f} | {extra} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--split", default="train")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the in-process run")
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--out", default="outputs/bench/simulate")
    args = parser.parse_args(argv)
    out = Path(args.out)
    target = prepare_testbed_target()
    config = SimConfig(sessions=args.sessions, split=args.split, seed=args.seed)

    in_process = simulate(config, out / "in-process", target, num_threads=args.threads, progress=False)

    state = out / "server"
    started = time.perf_counter()
    spec = start(state, make_spec(target, ENGINE_FLAGS, args.port, served_model_name="target"))
    startup = time.perf_counter() - started
    try:
        served = simulate(config, out / "vllm", target, server_url=url_of(spec), progress=False)
    finally:
        stop(state)

    by_id = {r.request_id: r.output_ids.tolist() for r in in_process.records}
    same = sum(by_id.get(r.request_id) == r.output_ids.tolist() for r in served.records)
    result = {"args": vars(args), "in_process": in_process.summary, "vllm": served.summary,
              "vllm_startup_seconds": startup, "same_output_ids": same, "requests": len(served.records),
              "speedup": in_process.summary["wall_seconds"] / served.summary["wall_seconds"]}
    table = "\n".join([
        "| how | main sessions (all) | requests | wall s | s per main session | generated tok/s | logged tok/s | |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        row(f"in process, {args.threads} torch thread{'s' if args.threads > 1 else ''}", in_process.summary),
        row("vLLM server (CPU build, bf16)", served.summary,
            f"start-up {startup:.0f} s; {same} of {len(served.records)} requests with the same output ids"),
    ]) + f"\n\nvLLM against in process, wall: {result['speedup']:.2f}x\n"
    write_text_atomic(out / "simulate.md", table)
    write_text_atomic(out / "simulate.json", json.dumps(result, indent=1, default=str))
    print(table)
    return result


if __name__ == "__main__":
    main()
