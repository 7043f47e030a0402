"""Stage 1 with the engine's features against the in-process ones, on the same prompts and steps.

    python -m bench.bench_engine_features --out outputs/bench/engine-features [--samples 240 --prefilled 200 --steps 540]

Runs train/dflash.py twice with configs/testbed.yaml: `target.backend: hf` (transformers regenerates and
keeps the features of what it generates) and `target.backend: vllm` (vLLM regenerates, and vLLM's
extract_hidden_states captures every row; the training process never loads the target's body). Both draw
the same prompts and take the same number of steps; then bench/bench_heldout_tau.py scores both drafters
on the same held-out code and prose continuations of the fp32 target, side by side in one process. Each run
resumes from its checkpoints if killed. Writes `<out>/result.json` and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(out: Path, backend: str, args) -> float:
    """Seconds the run took (0 when its drafter already exists)."""
    if (out / "checkpoints" / f"step-{args.steps:06d}" / "drafter").is_dir():
        return 0.0
    command = [sys.executable, str(REPO / "train" / "dflash.py"), "--config", str(REPO / "configs" / "testbed.yaml"),
               f"output_dir={out}", f"target.backend={backend}", f"data.mixture.num_samples={args.samples}",
               f"data.mixture.prefilled_samples={args.prefilled}", f"train.max_steps={args.steps}",
               "train.snapshot_every=null", "logging.wandb=false"]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return time.perf_counter() - started


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/engine-features"))
    parser.add_argument("--samples", type=int, default=240, help="regenerated prompts (the quickstart: 480)")
    parser.add_argument("--prefilled", type=int, default=200, help="prefilled code samples (the quickstart: 400)")
    parser.add_argument("--steps", type=int, default=540, help="optimizer steps of each run (the quickstart: 1,085)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts per category")
    args = parser.parse_args(argv)

    seconds = {backend: train(args.out / backend, backend, args) for backend in ("hf", "vllm")}
    scored = subprocess.run([sys.executable, "-m", "bench.bench_heldout_tau", f"hf={args.out / 'hf'}",
                             f"vllm={args.out / 'vllm'}", "--prompts", str(args.prompts),
                             "--cache", str(args.out / "heldout_continuations.pt")],
                            cwd=REPO, check=True, capture_output=True, text=True).stdout
    taus = {row["drafter"]: row for row in map(json.loads, scored.strip().splitlines())}
    result = {"samples": args.samples, "prefilled": args.prefilled, "steps": args.steps, "prompts": args.prompts,
              "train_seconds": seconds, "heldout": taus,
              "difference_vllm_minus_hf": {c: round(taus["vllm"][c]["sim_tau"] - taus["hf"][c]["sim_tau"], 3)
                                           for c in ("code", "prose")}}
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
