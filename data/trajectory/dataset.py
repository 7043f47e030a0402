"""Stage-2 training data: logged trajectories -> prefix tree -> root-to-leaf training windows, prepared once.

The prepared artifact lives under `<cache>/datasets/trajectories-<key>/` (`dataset/`, `manifest.json`,
`quarantine.jsonl`); the key covers the log files' content, the target's content fingerprint and the
settings that shape the windows, so a new or rewritten log file is a new artifact and an unchanged set is
read, not rebuilt."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from datasets import Dataset, load_from_disk

from common.atomic_files import atomic_folder, write_json_atomic
from configs.schema import DataConfig, TargetConfig
from data.trajectory.files import expand_paths
from data.trajectory.prefix_tree import build_prefix_tree
from data.trajectory.reader import TrajectoryReader
from drafters.target.fingerprint import target_fingerprint
from drafters.target.loading import load_target_config

MANIFEST = "manifest.json"


def trajectory_key(data: DataConfig, target: TargetConfig, target_path: Path) -> tuple[str, list[dict]]:
    """The artifact's key and the files it covers (path, bytes, sha256)."""
    if not data.trajectories:
        raise ValueError("train.stage is 'finetune' but data.trajectories lists no log files or folders")
    files = []
    for path in expand_paths(data.trajectories):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        files.append({"path": str(path), "bytes": path.stat().st_size, "sha256": digest.hexdigest()})
    settings = {"files": sorted(f["sha256"] for f in files), "max_seq_len": data.max_seq_len,
                "max_record_bytes": data.max_record_bytes,
                "target": target_fingerprint(target_path, target.fingerprint)}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12], files


def trajectory_dataset_dir(data: DataConfig, target: TargetConfig, target_path: Path, cache_root: Path) -> Path:
    return Path(cache_root) / "datasets" / f"trajectories-{trajectory_key(data, target, target_path)[0]}"


def build_trajectory_dataset(data: DataConfig, target: TargetConfig, target_path: Path, cache_root: Path,
                             report_dir: Path | None = None) -> Dataset:
    """The prepared stage-2 dataset: read when it exists, else built (and quarantined records written with their
    reasons). report_dir: also gets a copy of its manifest (trajectory_summary.json) and quarantine."""
    key, files = trajectory_key(data, target, target_path)
    out_dir = Path(cache_root) / "datasets" / f"trajectories-{key}"
    if not (out_dir / MANIFEST).exists():
        _prepare(data, target, target_path, files, out_dir)
    manifest = json.loads((out_dir / MANIFEST).read_text())
    if report_dir is not None:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(report_dir) / "trajectory_summary.json", manifest)
        if (out_dir / "quarantine.jsonl").exists():
            shutil.copyfile(out_dir / "quarantine.jsonl", Path(report_dir) / "quarantine.jsonl")
    ingest, tree = manifest["ingest"], manifest["tree"]
    print(f"[data] trajectories ({out_dir}): read {ingest['read']}, accepted {ingest['accepted']}, quarantined "
          f"{ingest['quarantined']} {ingest.get('by_reason', {})}; unique tokens {tree['unique_tokens']} of "
          f"{tree['logged_tokens']} logged (dedup {tree['dedup_ratio']:.1f}x)", flush=True)
    if ingest["accepted"] == 0:
        raise ValueError(f"no usable trajectory records in {data.trajectories} (all {ingest['quarantined']} "
                         f"quarantined; see {out_dir / 'quarantine.jsonl'})")
    return load_from_disk(str(out_dir / "dataset"))


def _prepare(data: DataConfig, target: TargetConfig, target_path: Path, files: list[dict], out_dir: Path) -> None:
    vocab_size = load_target_config(target_path, target.trust_remote_code).vocab_size
    with atomic_folder(out_dir) as building:
        reader = TrajectoryReader([f["path"] for f in files], vocab_size, quarantine_path=building / "quarantine.jsonl",
                                  max_record_bytes=data.max_record_bytes)
        tree = build_prefix_tree(reader)
        summary = reader.summary
        summary.check()
        if summary.accepted:  # all quarantined: the manifest and the quarantine are kept, the caller refuses
            tree.to_dataset(max_seq_len=data.max_seq_len).save_to_disk(str(building / "dataset"))
        manifest = {"kind": "dflash-prepared-trajectories", "files": files,
                    "target": {"path": str(Path(target_path).resolve()),
                               "fingerprint": target_fingerprint(target_path, target.fingerprint)},
                    "max_seq_len": data.max_seq_len,
                    # where the quarantine will be once the folder is in place, not the folder being built
                    "ingest": {**summary.to_dict(), "quarantine_path": str(out_dir / "quarantine.jsonl")},
                    "tree": tree.stats().to_dict()}
        write_json_atomic(building / MANIFEST, manifest)
