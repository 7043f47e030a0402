"""A cycle in progress (what it works on, the history record it fills in) and what it commits: one atomic state
write (consumed files and requests, promotion, counter), then the ``current`` symlink and history line that
follow it, the metrics, and the one-line summary."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from common.atomic_files import write_json_atomic
from configs.schema import PipelineConfig
from data.trajectory.reader import content_key
from retraining.state import StateDir, commit, now_iso

SESSION_ROOT_TTL_CYCLES = 168  # remembered sub-agent -> root session links expire after this many cycles


def log_cycle_to_wandb(config: PipelineConfig, sd: StateDir, record: dict, log) -> None:
    if not config.logging.wandb or config.logging.wandb_mode == "disabled":
        return
    try:
        import wandb
    except ImportError:
        log("[retrain] logging.wandb is set but wandb is not installed; skipped")
        return
    flat: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, bool):
            flat[prefix] = float(value)
        elif isinstance(value, (int, float)):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)

    walk("", {k: v for k, v in record.items() if k not in ("files",)})
    os.environ.setdefault("WANDB_MODE", config.logging.wandb_mode)
    run = wandb.init(project=config.logging.wandb_project, name=f"{config.run_name}-retrain-cycle{record['cycle']:04d}",
                     group=f"{config.run_name}-retrain", job_type="retrain", dir=str(sd.root),
                     config={"retrain": config.retrain.model_dump(mode="json")})
    run.log(flat, step=int(record["cycle"]))
    run.summary["status"] = record["status"]
    run.finish()


def commit_cycle(config: PipelineConfig, sd: StateDir, state: dict, record: dict, files: list[dict], *, consume: bool,
            roots: dict[str, str] | None = None, version: tuple[str, dict] | None = None, requests: list[str] = (),
            log=print) -> dict:
    """One atomic state write (consumption, promotion, counter), then the symlink, history and wandb."""
    cycle = record["cycle"]
    if consume:
        for key in requests:  # content keys of the accepted requests: a re-shipped copy is quarantined later
            state["requests"].setdefault(key, cycle)
        per_file = {f["path"]: f for f in record.get("files", [])}
        for f in files:
            info = per_file.get(f["path"], {})
            state["consumed"][f["path"]] = {
                "size": f["size"], "sha256": f["sha256"], "cycle": cycle, "status": info.get("status", f["status"]),
                **{k: info[k] for k in ("read", "accepted", "quarantined") if k in info}}
    if roots:
        for sid, root in roots.items():
            if root != sid:
                state["session_roots"][sid] = [root, cycle]
    state["session_roots"] = {s: v for s, v in state["session_roots"].items()
                              if cycle - v[1] <= SESSION_ROOT_TTL_CYCLES}
    if version is not None:
        name, info = version
        state["versions"][name] = info
        state["promoted"] = name
    state["cycle"] = cycle
    state["in_progress"] = None
    state["cycles"].append({k: record.get(k) for k in ("cycle", "status", "finished", "current_version",
                                                          "promoted_version", "tau_current", "tau_candidate")})
    state["last_record"] = record
    commit(sd, state)
    log("[retrain] metrics " + json.dumps({k: v for k, v in record.items() if k not in ("files", "exports")},
                                          default=str, separators=(",", ":")))
    try:
        log_cycle_to_wandb(config, sd, record, log)
    except Exception as err:  # metrics must never undo a committed cycle
        log(f"[retrain] wandb logging failed: {type(err).__name__}: {err}")
    return record


def summary_line(record: dict) -> str:
    status, c = record["status"], record["cycle"]
    if status == "no_new_data":
        return f"[retrain] cycle {c}: no new data under {record['incoming']}; nothing to do (no training, no promotion)"
    head = f"[retrain] cycle {c}: {status}"
    if record.get("tau_candidate") is not None:
        head += (f"; tau current {record['current_version']} {record['tau_current']:.3f} -> candidate "
                 f"{record['tau_candidate']:.3f}")
    return f"{head}. {record['reason']}"


@dataclass
class Cycle:
    """One cycle in progress: what it works on, the history record it fills in, and its phase timings."""

    config: PipelineConfig
    sd: StateDir
    state: dict
    log: Callable
    started: float
    phase: dict[str, float]
    target_path: Path
    target_config: Any
    current_version: str
    current_drafter: Path
    number: int = 0
    files: list[dict] = field(default_factory=list)
    dir: Path | None = None
    record: dict = field(default_factory=dict)
    records: list = field(default_factory=list)  # the accepted requests

    def finish(self, status: str, reason: str, *, consume: bool = True, roots=None, version=None) -> dict:
        """Write cycle.json and commit the cycle with this outcome."""
        record = self.record
        record["status"], record["reason"] = status, reason
        record["finished"] = now_iso()
        self.phase["total"] = time.time() - self.started
        record["seconds"] = {k: round(v, 3) for k, v in self.phase.items()}
        write_json_atomic(self.dir / "cycle.json", record)
        commit_cycle(self.config, self.sd, self.state, record, self.files, consume=consume, roots=roots, version=version,
                     requests=[content_key(r) for r in self.records], log=self.log)
        self.log(summary_line(record))
        return record


@dataclass
class Split:
    roots: dict[str, str]   # session id -> root session id
    train: list             # requests to train on
    heldout: list           # this cycle's held-out requests
    window: list[str]       # the held-out files the gate evaluates on (this cycle's and earlier ones)
