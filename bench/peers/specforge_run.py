"""SpecForge's own DFlash trainer (`specforge train`), run unchanged on the CPU, its checkpoints made snapshots.

Run with the python of a virtual environment that has PyPI `specforge` 0.2.0 (not ours):

    SPECFORGE_PYTHON bench/peers/specforge_run.py --out RUN --recipe RECIPE.yaml [section.key=value ...]

RECIPE.yaml is a SpecForge training recipe (bench/bench_peers.py writes it: their offline DFlash recipe with our
drafter shape and data). Two of its settings are what lets SpecForge's trainer run on a CPU at all, both
SpecForge's own options: `training.fsdp_sharding: NO_SHARD` (their default wraps the drafter in FSDP, which
stops with "RuntimeError: FSDP needs a non-CPU accelerator device, but no accelerator device is detected";
NO_SHARD makes it DDP over gloo) and `training.attention_backend: sdpa` (flex_attention stops in the first
backward with "NotImplementedError: FlexAttention does not support backward on CPU").

The trainer runs as a child process; its per-step log lines are kept (RUN/train.log) and timed. Afterwards
every checkpoint is exported with SpecForge's own exporter (specforge.export.to_hf) and written as
RUN/snapshots/step-NNNNNN/ (the exported weights, the drafter config of the recipe, and trainer_state.json
with the wall seconds from the start of this script to the checkpoint's write), the layout of our
trainer's snapshots. The training checkpoints (optimizer state included) are deleted once exported.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

STEP_LINE = re.compile(r"^step (\d+): (\{.*\})\s*$")


def export_snapshots(output_dir: Path, run_id: str, draft_config: Path, target: str, out: Path, started: float) -> list[int]:
    from specforge.export.to_hf import export_to_hf

    steps = []
    pattern = re.compile(rf"^{re.escape(run_id)}-step(\d+)$")
    for folder in sorted(output_dir.iterdir()):
        match = pattern.match(folder.name)
        if not match or folder.is_symlink():
            continue
        step = int(match.group(1))
        written = max(p.stat().st_mtime for p in folder.iterdir())
        snapshot = out / "snapshots" / f"step-{step:06d}"
        exported = out / "exported" / folder.name
        export_to_hf(str(folder), str(draft_config), str(exported), embedding_source=target)
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(exported / "model.safetensors", snapshot / "model.safetensors")
        shutil.copyfile(draft_config, snapshot / "config.json")
        (snapshot / "trainer_state.json").write_text(json.dumps(
            {"step": step, "elapsed_seconds": written - started}, indent=2) + "\n")
        shutil.rmtree(exported)
        shutil.rmtree(folder)
        steps.append(step)
    return steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    started_wall, started = time.time(), time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import yaml

    recipe = yaml.safe_load(Path(args.recipe).read_text())
    step_seconds, losses, accuracies = [], [], []
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specforge.cli", "train", "-c", args.recipe, *args.overrides],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            match = STEP_LINE.match(line.strip())
            if match:
                values = ast.literal_eval(match.group(2))
                step_seconds.append(float(values.get("perf/optimizer_step_time_s", float("nan"))))
                losses.append(float(values.get("loss", float("nan"))))
                accuracies.append(float(values.get("acc", float("nan"))))
        code = proc.wait()
    train_seconds = time.perf_counter() - started
    if code != 0:
        tail = (out / "train.log").read_text().splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"specforge train exited with status {code} (log: {out / 'train.log'})")
    output_dir = Path(recipe["output_dir"])
    steps = export_snapshots(output_dir, recipe["run_id"], Path(recipe["model"]["draft_model_config"]),
                             recipe["model"]["target_model_path"], out, started_wall)
    result = {"trainer": "SpecForge (specforge train, unchanged)", "steps": len(step_seconds),
              "snapshots": steps, "wall_seconds": train_seconds,
              "mean_step_seconds": sum(step_seconds) / max(len(step_seconds), 1), "step_seconds": step_seconds,
              "final_loss": losses[-1] if losses else None, "final_acc": accuracies[-1] if accuracies else None,
              "export_seconds": time.perf_counter() - started - train_seconds}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
