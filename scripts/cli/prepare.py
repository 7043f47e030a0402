"""Prepare a run's data, apart from training: sources -> regeneration -> target features, with a manifest
(train/prepare.py says what is built where).

    dflash-pipeline prepare --config configs/testbed.yaml [section.key=value ...]
    accelerate launch -m scripts.cli prepare --config ...                     # every process takes its share
    torchrun --nnodes 2 --nproc-per-node 1 -m scripts.cli prepare --config ... # one engine replica per node

Give it the config and overrides the training run will get. Its last line of output is the manifest, as one
line of JSON from the main process, with the feature capture's report under "features".
"""

from __future__ import annotations

import json
import sys

from configs.schema import ConfigError, load_config
from scripts.cli.refusal import refuse
from train.prepare import emit_json_line, engine_logs_to_stderr, prepare


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="configs/testbed.yaml", help="YAML config (the training run's)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, the training run's")


def run(args) -> int:
    engine_logs_to_stderr()
    try:
        manifest = prepare(load_config(args.config, args.overrides))
    except (ConfigError, ValueError, FileNotFoundError) as err:
        return refuse(err, 2)
    if manifest["rank"] == 0:
        emit_json_line(manifest)
    else:  # one manifest on stdout; the other ranks' capture reports go with their logs
        print(f"[prepare] rank {manifest['rank']}: {json.dumps(manifest.get('features'))}", file=sys.stderr, flush=True)
    return 0
