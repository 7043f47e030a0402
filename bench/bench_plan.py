"""The plan (train/plan.py) against a measured training step on the testbed, side by side.

    python -m bench.bench_plan [--seq-len 1024] [--steps 4] [section.key=value ...]

Runs train/dflash.py on configs/testbed.yaml (with the overrides) for --steps steps over one batch of rows of exactly
data.max_seq_len tokens that the target wrote greedily (so that every slot the plan bounds is supervised), measures
one real step from the outside (train/plan.py measure_training_step: tensor sizes, autograd's saved tensors,
torch.profiler's allocations, the time between optimizer steps) and prints the plan's figure, the measured one and
their ratio, then one JSON line. The bars (issue 41): every modelled tensor within 20%, the step time within 2x.
Pass train.head_vocab=null: a reduced head holds the tokens the target emits on the data, which one batch cannot fill.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from configs.schema import load_config
from drafters.target.testbed import prepare_testbed_target
from train.plan import build_plan, greedy_rows, measure_training_step

TENSORS = ("weights", "gradients", "optimizer", "activations", "loss_peak")


def compare(seq_len: int, steps: int, overrides: list[str], rows: int | None = None, work: Path | None = None) -> dict:
    from datasets import Dataset

    target = prepare_testbed_target()
    work = Path(work or tempfile.mkdtemp(prefix="bench-plan-"))
    base = load_config("configs/testbed.yaml", overrides)
    rows = rows or base.train.batch_size  # one batch, read again every step (each step is an epoch)
    data = greedy_rows(target, rows, seq_len)
    Dataset.from_dict({"input_ids": data, "loss_mask": [[1] * seq_len for _ in data]}).save_to_disk(str(work / "data"))
    config = load_config("configs/testbed.yaml", [
        f"target.path={target}", f"data.dataset={work / 'data'}", f"cache_dir={work / 'cache'}",
        f"output_dir={work / 'out'}", f"data.max_seq_len={seq_len}", f"train.max_steps={steps}",
        "logging.wandb=false", "train.snapshot_every=null", *overrides])
    measured = measure_training_step(config)
    plan = build_plan(config, hardware="cpu")
    modelled = {**{k: plan.memory[k] for k in TENSORS}, "step": plan.time["step"]}
    return {"config": "configs/testbed.yaml", "overrides": overrides, "seq_len": seq_len, "rows": rows,
            "plan": modelled, "measured": measured,
            "ratio": {k: modelled[k] / measured[k] for k in (*TENSORS, "step")},
            "cpu_gflops": plan.hardware["flops"] / 1e9, "supervised_rows_bound": plan.memory["step_shapes"]["supervised_rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=1024, help="data.max_seq_len and every row's length")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-plan-"))
    try:
        result = compare(args.seq_len, args.steps, args.overrides, work=work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'':14}{'plan':>12}{'measured':>12}{'plan/measured':>15}")
    for key in (*TENSORS, "step"):
        unit, scale = ("s", 1) if key == "step" else ("MB", 1e6)
        print(f"{key:14}{result['plan'][key] / scale:>10.2f}{unit:>2}{result['measured'][key] / scale:>10.2f}{unit:>2}"
              f"{result['ratio'][key]:>15.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
