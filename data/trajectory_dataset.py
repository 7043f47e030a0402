"""Stage-2 training data: logged trajectories -> prefix tree -> root-to-leaf training windows."""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset
from drafters.target_loading import load_target_config

from configs.schema import PipelineConfig
from data.prefix_tree import build_prefix_tree
from data.trajectories import TrajectoryReader


def build_trajectory_dataset(config: PipelineConfig, target_path: Path, cache_root: Path | None = None) -> Dataset:
    if not config.data.trajectories:
        raise ValueError("train.stage is 'finetune' but data.trajectories lists no log files or folders")
    vocab_size = load_target_config(target_path, config.target.trust_remote_code).vocab_size
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    reader = TrajectoryReader(config.data.trajectories, vocab_size, quarantine_path=output_dir / "quarantine.jsonl",
                              max_record_bytes=config.data.max_record_bytes)
    tree = build_prefix_tree(reader)
    summary = reader.summary
    summary.check()
    stats = tree.stats()
    report = {"ingest": summary.to_dict(), "tree": stats.to_dict()}
    (output_dir / "trajectory_summary.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"[data] trajectories: read {summary.read}, accepted {summary.accepted}, quarantined {summary.quarantined} "
          f"{dict(summary.by_reason)}; unique tokens {stats.unique_tokens} of {stats.logged_tokens} logged "
          f"(dedup {stats.dedup_ratio:.1f}x)", flush=True)
    if summary.accepted == 0:
        raise ValueError(f"no usable trajectory records in {config.data.trajectories} (all {summary.quarantined} quarantined; see {output_dir / 'quarantine.jsonl'})")
    return tree.to_dataset(max_seq_len=config.data.max_seq_len)
