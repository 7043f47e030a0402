"""Plan a run before renting the cluster: memory per GPU, feature bytes, regeneration, capture and training time
(train/plan.py).

    dflash-pipeline plan --config configs/kimi-k2.6.yaml [section.key=value ...] [--processes 16] [--json]
"""

from __future__ import annotations

from configs.schema import ConfigError, load_config
from scripts.cli.refusal import refuse
from train.plan import HARDWARE, PlanError, build_plan, print_plan


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="configs/testbed.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.batch_size=1")
    parser.add_argument("--processes", type=int, help="training processes (GPUs); default: the config header's launch line")
    parser.add_argument("--accelerate-config", help="accelerate config file of the launch (its ZeRO stage)")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), help="default: cpu for the testbed target, else h200")
    parser.add_argument("--regen-tokens-per-s", type=float, help="regeneration output tokens/s per engine replica")
    parser.add_argument("--capture-tokens-per-s", type=float, help="feature capture tokens/s per engine replica")
    parser.add_argument("--train-utilisation", type=float, help="share of the peak FLOP/s a training step sustains")
    parser.add_argument("--json", action="store_true", help="only the JSON line")


def run(args) -> int:
    try:
        config = load_config(args.config, args.overrides)
        what_ifs = dict(processes=args.processes, accelerate_config=args.accelerate_config, hardware=args.hardware,
                        regen_tokens_per_s=args.regen_tokens_per_s, capture_tokens_per_s=args.capture_tokens_per_s,
                        train_utilisation=args.train_utilisation)
        if args.json:
            print(build_plan(config, args.config, **what_ifs).to_json())
        else:
            print_plan(config, args.config, **what_ifs)
    except (ConfigError, PlanError, ValueError, FileNotFoundError) as err:
        return refuse(err, 2)
    return 0
