"""Train a DFlash drafter (train/loop.py).

    accelerate launch train/dflash.py --config configs/testbed.yaml [section.key=value ...]
    dflash-pipeline train --config configs/testbed.yaml [section.key=value ...]     (one process)

Stage "general" trains on the target-regenerated mixture, stage "finetune" starts from a stage-1 checkpoint
(`train.init_from`, weights only) and trains on trajectory datasets. A run continues from the newest checkpoint
in its output_dir. A run that diverges stops with exit status 3, its newest checkpoint the last good one.
"""

from __future__ import annotations

from configs.schema import ConfigError, load_config
from scripts.cli.refusal import refuse
from train.batches import DatasetError
from train.loop import EXIT_DIVERGED, TrainingDiverged, train
from train.plan import print_plan


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="configs/testbed.yaml", help="YAML config (default: the CPU testbed)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    parser.add_argument("--dry-run", action="store_true", help="print the run's plan (memory per GPU, feature bytes, "
                        "regeneration, capture and training time; `dflash-pipeline plan`) and exit: no weights, no data")


def run(args) -> int:
    try:
        config = load_config(args.config, args.overrides)
        if args.dry_run:
            print_plan(config, args.config)
            return 0
        train(config)
    except (ConfigError, DatasetError, ValueError, FileNotFoundError) as err:
        return refuse(err, 2)
    except TrainingDiverged as err:
        return refuse(err, EXIT_DIVERGED)
    return 0
