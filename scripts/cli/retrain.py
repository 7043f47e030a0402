"""Continuous retraining (retraining/cycle.py): one cycle per run, or manage the versions.

    dflash-pipeline retrain --config configs/retrain-testbed.yaml [section.key=value ...]
    dflash-pipeline retrain --config ... --status
    dflash-pipeline retrain --config ... --rollback v0002
    dflash-pipeline retrain --config ... --bootstrap         # v0000 = retrain.initial_drafter, then on_promote

Schedule the first form (cron, a Kubernetes CronJob with concurrencyPolicy: Forbid); scripts/RETRAIN.md has the
state folder's layout. Exit status: 0 done, 2 bad input, 3 training diverged (the cycle resumes), 4 the new version
is current but retrain.on_promote failed (retry with --notify), 75 another cycle holds the lock.
"""

from __future__ import annotations

import json
import sys

from common.locks import Busy
from configs.schema import ConfigError, load_config
from retraining.cycle import EXIT_BUSY, EXIT_HOOK_FAILED, run_cycle
from retraining.hooks import HookFailed
from retraining.state import RetrainError
from retraining.versions import install_initial, notify, rollback, status
from scripts.cli.refusal import refuse
from train.loop import EXIT_DIVERGED, TrainingDiverged


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="configs/retrain-testbed.yaml", help="pipeline YAML with a retrain section")
    parser.add_argument("--rollback", metavar="VERSION", default=None, help="point `current` at an earlier version and exit")
    parser.add_argument("--status", action="store_true", help="print the state summary as JSON and exit")
    parser.add_argument("--notify", action="store_true", help="run retrain.on_promote again for the current version")
    parser.add_argument("--bootstrap", action="store_true", help="install retrain.initial_drafter as v0000 (running "
                        "retrain.on_promote) and exit; a cycle does this itself when no version exists")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. retrain.promotion_margin=0.05")


def run(args) -> int:
    try:
        config = load_config(args.config, args.overrides)
        if args.status:
            print(json.dumps(status(config), indent=2, default=str))
        elif args.rollback:
            rollback(config, args.rollback)
        elif args.notify:
            notify(config)
        elif args.bootstrap:
            install_initial(config)
        else:
            run_cycle(config)
    except HookFailed as err:
        return refuse(err, EXIT_HOOK_FAILED)
    except Busy as err:
        print(f"[retrain] {err}", file=sys.stderr)
        return EXIT_BUSY
    except (ConfigError, RetrainError, FileNotFoundError) as err:
        return refuse(err, 2)
    except TrainingDiverged as err:
        return refuse(err, EXIT_DIVERGED, " (the cycle stays in progress and resumes from that checkpoint)")
    return 0
