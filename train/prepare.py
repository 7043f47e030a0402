"""Prepare a run's data, before and apart from training: sources -> regeneration -> target features -> the
prepared dataset, with its manifest.

    dflash-pipeline prepare --config configs/testbed.yaml [section.key=value ...]
    accelerate launch -m scripts.cli prepare --config ...          # every process takes its share
    torchrun --nnodes 2 --nproc-per-node 1 -m scripts.cli prepare --config ...   # one engine replica per node

Give it the config and overrides the training run will get: it builds the same artifacts training reads.
- Stage 1 (`train.stage: general`): the regenerated mixture under `<cache>/datasets/mixture-<key>/` (the key
  covers the sources' content, the target's content fingerprint and the generation settings): `dataset/`,
  `manifest.json` (sources and their counts, the target's fingerprint, chat template and thinking setting,
  generation settings, quarantine counts), `sources_quarantine.jsonl` (the records of the user's sources
  that were not used, each with its reason) and `quarantine.jsonl` (prompts regeneration refused).
- Stage 2 (`train.stage: finetune`): the logged trajectories merged into a prefix tree, under
  `<cache>/datasets/trajectories-<key>/` (the key covers the logs' content): `dataset/`, `manifest.json`
  (files, ingest and tree counts), `quarantine.jsonl`.
- Then, with `features.mode: offline`, the target features of every row into the feature cache
  (`<cache>/features/cache-<key>/`, data/FEATURE_CACHE_FORMAT.md), through the engine the config names.

Every process regenerates and captures its own share; ranks never wait on each other's capture, and the
last one marks the cache complete. A killed preparation resumes: finished shards are kept. Training reads
these artifacts, and builds them through this same code when they are missing (the one-command
quickstart); a multi-process training run refuses to start without a complete feature cache.
Its last line of output is the manifest, as one line of JSON (printed by the main process), with the feature
capture's report under "features" (what its target computed against what the cache holds; the other ranks
log theirs).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import PartialState

from configs.schema import PipelineConfig
from data.sources import mixture
from data.trajectory import dataset as trajectory_data
from drafters.target.loading import load_target_config
from train.features import capture_feature_cache
from train.setup import cache_root, drafter_layer_ids, resolve_target, training_dataset


def prepare(config: PipelineConfig) -> dict:
    """Build (or resume) this config's dataset and, in offline feature mode, this rank's share of its feature
    cache; returns the dataset's manifest with the capture report under "features"."""
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    # The process group only orders the dataset's preparation; a share can take hours, and the capture
    # needs no collective, so a slow or restarted rank never holds the others.
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(hours=12))
    if state.device.type == "cpu":
        torch.set_num_threads(config.train.cpu_threads or max(1, len(os.sched_getaffinity(0)) // state.num_processes))
    target_path = resolve_target(config, log)
    layer_ids = drafter_layer_ids(config, target_path, load_target_config(target_path, config.target.trust_remote_code))
    dataset = training_dataset(config, target_path, state, layer_ids)
    manifest = dataset_manifest(config, target_path, cache_root(config))
    if config.features.mode == "offline":
        manifest["features"] = capture_feature_cache(config, dataset, target_path, layer_ids, cache_root(config),
                                                     state.device, rank=state.process_index,
                                                     world_size=state.num_processes, log=log)
    manifest["rank"], manifest["world_size"] = state.process_index, state.num_processes
    return manifest


def dataset_manifest(config: PipelineConfig, target_path: Path, cache: Path) -> dict:
    """The manifest of the dataset this config trains on."""
    if config.rows_from == "dataset":
        return {"kind": "dflash-dataset", "path": str(config.data.dataset)}
    if config.rows_from == "mixture":
        return json.loads((mixture.mixture_dir(config.data, config.target, target_path, cache) / mixture.MANIFEST).read_text())
    folder = trajectory_data.trajectory_dataset_dir(config.data, config.target, target_path, cache)
    return json.loads((folder / trajectory_data.MANIFEST).read_text())


def emit_json_line(obj: dict) -> None:
    """One write per line: the processes of a launch share stdout, and print() writes the text and the newline
    apart, so two ranks' lines could run together."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def engine_logs_to_stderr() -> None:
    """vLLM logs to stdout by default, down to its shutdown at exit: stdout carries only our JSON line."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
