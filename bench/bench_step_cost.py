"""What a training setting costs a step: train/dflash.py itself, each variant as its own process, interleaved.

    python -m bench.bench_step_cost --steps 60 --rounds 2 \
        base="train.copy_value_weight=null train.copy_weight=0.1" value="train.copy_value_weight=1.0"

Each variant is a set of dotted overrides of --config (the testbed quickstart by default; its data and features come
from the cache, so the first run prepares them). A run trains --steps steps and keeps snapshots at half and all of
them; the steady seconds per step is the wall time between the two (trainer_state.json's elapsed_seconds), so
start-up, data loading and the first steps' warm-up are left out. Variants alternate (A B A B ...) so that the
machine's load falls on all of them alike. Prints one JSON line: seconds per step per run, their mean per variant,
and each variant's mean against the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def seconds_per_step(config: str, overrides: list[str], steps: int, threads: int, out: Path) -> float:
    half = steps // 2
    cmd = [sys.executable, str(REPO / "train" / "dflash.py"), "--config", config, *overrides, f"output_dir={out}",
           f"train.max_steps={steps}", f"train.snapshot_every={half}", f"train.save_every={steps}",
           f"train.cpu_threads={threads}", "logging.wandb=false", "train.resume=false"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    elapsed = {}
    for step in (half, steps):
        state = json.loads((out / "snapshots" / f"step-{step:06d}" / "trainer_state.json").read_text())
        elapsed[step] = state["elapsed_seconds"]
    return (elapsed[steps] - elapsed[half]) / (steps - half)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help='NAME="dotted overrides ..." (the first is the baseline)')
    parser.add_argument("--config", default=str(REPO / "configs" / "testbed.yaml"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps must be at least 4 (the steady rate is measured over the second half)")
    variants = {name: shlex.split(overrides) for name, _, overrides in (v.partition("=") for v in args.variants)}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="step-cost-") as scratch:
        for round_index in range(args.rounds):
            for name, overrides in variants.items():
                out = Path(scratch) / f"{name}-{round_index}"
                runs[name].append(round(seconds_per_step(args.config, overrides, args.steps, args.threads, out), 4))
                print(json.dumps({"variant": name, "round": round_index, "seconds_per_step": runs[name][-1]}),
                      file=sys.stderr, flush=True)
    mean = {name: sum(v) / len(v) for name, v in runs.items()}
    first = next(iter(mean.values()))
    print(json.dumps({"config": args.config, "steps": args.steps, "threads": args.threads, "variants": variants,
                      "seconds_per_step": runs, "mean": {k: round(v, 4) for k, v in mean.items()},
                      "against_first": {k: round(v / first, 3) for k, v in mean.items()}}))


if __name__ == "__main__":
    main()
