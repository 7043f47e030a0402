"""Capture a training run's offline feature cache on every GPU, before training.

    python -m train.capture_job --config configs/kimi-k2.6.yaml [section.key=value ...]     # one process
    accelerate launch -m train.capture_job --config configs/kimi-k2.6.yaml [...]            # every rank
    torchrun --nnodes 4 --nproc-per-node 1 -m train.capture_job --config ... [...]          # one replica per node

Give it the config and overrides the training run will get: it prepares the same dataset and the same
cache folder (train/features.py), and each rank captures its own contiguous block of the cache's shard
plan into that one folder (data/feature_cache). Ranks never wait for each other: the last one to finish
marks the cache complete. A killed job started again resumes: finished shards are kept, nothing stored
is computed twice (data/FEATURE_CACHE_FORMAT.md). Rows are bounded by data.max_seq_len.

With `target.device_map` (a target sharded over a node's GPUs) launch one process per node, each
holding one replica; otherwise one process per GPU. Training (`accelerate launch train/dflash.py`)
then only reads the cache; a multi-process training run refuses to start without a complete one.
Each rank prints one JSON line: what its target computed (`target_tokens`) against what the cache holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

from configs.schema import ConfigError, PipelineConfig, load_config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/testbed.yaml", help="YAML config (the training run's)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, the training run's, e.g. data.max_seq_len=3072")
    return parser.parse_args(argv)


def capture(config: PipelineConfig) -> dict:
    import torch
    from accelerate import PartialState

    from drafters.target_loading import load_target_config
    from train.features import capture_feature_cache
    from train.setup import cache_root, drafter_layer_ids, resolve_target, training_dataset

    if config.features.mode != "offline":
        raise ValueError("features.mode is online: training runs the target itself and reads no cache; "
                         "set features.mode=offline to capture one")
    # The process group only orders the dataset's preparation (rank 0 first), as in training; the capture
    # itself needs no collective, so a slow or restarted rank never holds the others.
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(hours=12))
    if state.device.type == "cpu":
        torch.set_num_threads(config.train.cpu_threads or max(1, len(os.sched_getaffinity(0)) // state.num_processes))
    target_path = resolve_target(config, state.print)
    target_config = load_target_config(target_path, config.target.trust_remote_code)
    layer_ids = drafter_layer_ids(config, target_path, target_config)
    dataset = training_dataset(config, target_path, state, layer_ids)
    return capture_feature_cache(config, dataset, target_path, layer_ids, cache_root(config), state.device,
                                 rank=state.process_index, world_size=state.num_processes,
                                 log=lambda msg: print(msg, file=sys.stderr, flush=True))


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        report = capture(load_config(args.config, args.overrides))
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
