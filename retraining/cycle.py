"""Continuous retraining: fine-tune the drafter on newly logged traffic, promote it only if it is better.

    python scripts/retrain.py --config configs/retrain-testbed.yaml [section.key=value ...]
    python scripts/retrain.py --config ... --status
    python scripts/retrain.py --config ... --rollback v0002

Schedule the first form (cron, Kubernetes CronJob with concurrencyPolicy: Forbid). Each run is ONE cycle:

1. ingest the trajectory logs (``retrain.incoming``) that arrived since the last cycle; a file is known by
   its absolute path + size + sha256, so a rewritten file is noticed; validation and quarantine are the
   data module's (``data.trajectories.TrajectoryReader``, one quarantine file per cycle, the summary
   reconciles);
2. split held-out traffic off BEFORE training sees it: by a hash of the session's ROOT session id (a
   sub-agent session follows the session that spawned it), all requests of a session on one side;
3. dedup the training requests into a prefix tree -> dataset; fine-tune the currently promoted drafter on
   it (``train.dflash.train``, stage finetune, weights-only ``init_from``, its own resumable output dir);
4. evaluate the current and the candidate drafter on the same held-out recent traffic (greedy, real
   speculative decoding against the target, ``eval.acceptance.evaluate``; T=0 mismatches reported);
5. promote the candidate only if its tau beats the current one by ``retrain.promotion_margin``: a new
   ``versions/vNNNN/`` (drafter, bf16 / FP8 exports, eval report) and the ``current`` symlink swapped
   atomically; older versions stay for ``--rollback``;
6. commit: one atomic write of ``state.json`` (consumed files, promoted version, cycle counter), then a
   line in ``history.jsonl`` (and wandb when ``logging.wandb``).

A cycle killed at any point leaves the promoted drafter intact; the next run resumes the same cycle
(same files, same initial drafter, training from its newest checkpoint) and consumes every file exactly
once. A cycle with no new data, or only quarantined data, trains nothing and says so. See
scripts/RETRAIN.md for the state-dir layout and the state file format.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common.atomic_files import atomic_folder, fsync_dir, make_readable, write_json_atomic
from common.locks import Busy, FileLock
from configs.schema import ConfigError, PipelineConfig, load_config

STATE_FORMAT = 1
SESSION_ROOT_TTL_CYCLES = 168  # remembered sub-agent -> root session links expire after this many cycles
EXIT_BUSY = 75  # EX_TEMPFAIL: another cycle holds the lock


class RetrainError(ValueError):
    """A configuration or state problem that stops the cycle before it changes anything."""


# --------------------------------------------------------------------------------------------------
# Small file utilities
# --------------------------------------------------------------------------------------------------


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def append_jsonl(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line of a killed append: ignored, repaired below
                continue
    return out


def swap_symlink(link: Path, target: str) -> None:
    """Point ``link`` at ``target`` atomically: a symlink under a temp name, then os.replace."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def copy_tree_atomic(src: Path, dst: Path) -> Path:
    """Copy a folder under a temp name next to ``dst`` and rename it into place (replacing ``dst``)."""
    with atomic_folder(dst) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        make_readable(tmp)
    return dst


# --------------------------------------------------------------------------------------------------
# The state directory
# --------------------------------------------------------------------------------------------------


class StateDir:
    """Layout of ``retrain.state_dir`` (see scripts/RETRAIN.md)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()
        self.state = self.root / "state.json"
        self.history = self.root / "history.jsonl"
        self.versions = self.root / "versions"
        self.current = self.root / "current"
        self.cycles = self.root / "cycles"
        self.lock = self.root / ".lock"

    def cycle_dir(self, cycle: int) -> Path:
        return self.cycles / f"cycle-{cycle:06d}"

    def version_dir(self, version: str) -> Path:
        return self.versions / version


def new_state() -> dict:
    return {"format": STATE_FORMAT, "created": now_iso(), "updated": None, "cycle": 0, "promoted": None,
            "versions": {}, "consumed": {}, "requests": {}, "in_progress": None, "session_roots": {}, "cycles": [],
            "last_record": None}


def load_state(sd: StateDir) -> dict:
    if not sd.state.exists():
        return new_state()
    try:
        state = json.loads(sd.state.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError: damaged, not written by us
        raise RetrainError(f"{sd.state} is not readable JSON ({type(err).__name__}: {err}). It is only ever replaced "
                           "whole (atomic rename), so it was damaged outside this script; restore it from a backup. "
                           "Nothing was changed.") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise RetrainError(f"{sd.state}: state format {found!r}, this script reads {STATE_FORMAT}")
    state.setdefault("requests", {})  # written before requests were remembered across cycles
    return state


def save_state(sd: StateDir, state: dict) -> None:
    state["updated"] = now_iso()
    write_json_atomic(sd.state, state)


def state_lock(sd: StateDir) -> FileLock:
    """One cycle (or rollback) at a time per state dir."""
    return FileLock(sd.lock, "another retrain cycle is running; not starting a second one")


def commit(sd: StateDir, state: dict) -> None:
    """Save the state file (the truth), then make the ``current`` symlink and history.jsonl follow it."""
    save_state(sd, state)
    repair(sd, state)


def repair(sd: StateDir, state: dict, log=None) -> None:
    """Make the ``current`` symlink and history.jsonl follow the state file (idempotent).

    After a commit this points ``current`` at ``state['promoted']`` and appends the last committed record;
    at start-up it finishes what a run killed between those steps left undone (and says so via log).
    """
    log = log or (lambda message: None)
    for stale in sd.root.glob(f".{sd.current.name}.tmp-*"):
        stale.unlink(missing_ok=True)
    promoted = state.get("promoted")
    if promoted:
        want = os.path.join(sd.versions.name, promoted)
        if not sd.current.is_symlink() or os.readlink(sd.current) != want:
            log(f"[retrain] repair: pointing {sd.current.name} at {want}")
            swap_symlink(sd.current, want)
    last = state.get("last_record")
    if last:
        ids = {r.get("id") for r in read_jsonl(sd.history)}
        if last["id"] not in ids:
            log(f"[retrain] repair: appending the committed record {last['id']} to {sd.history.name}")
            append_jsonl(sd.history, last)


def next_version(state: dict) -> str:
    numbers = [int(v[1:]) for v in state["versions"]]
    return f"v{(max(numbers) + 1) if numbers else 0:04d}"


# --------------------------------------------------------------------------------------------------
# Discovery of new files, ingestion, held-out split
# --------------------------------------------------------------------------------------------------


def discover(incoming: list[str], state: dict, sd: StateDir) -> list[dict]:
    """Files under ``incoming`` that are not consumed yet (new, or rewritten since), with their identity."""
    from data.trajectories import expand_paths

    missing = [p for p in incoming if not Path(p).exists()]
    if missing:
        raise RetrainError(f"retrain.incoming path(s) {missing} do not exist")
    consumed = state["consumed"]
    known_hashes = {v["sha256"]: k for k, v in consumed.items()}
    out: list[dict] = []
    seen_now: dict[str, str] = {}
    for f in expand_paths(incoming):
        path = Path(os.path.abspath(f))
        if sd.root == path or sd.root in path.parents:
            continue  # our own held-out / quarantine files, if incoming contains the state dir
        st = path.stat()
        sha = sha256_file(path)
        prev = consumed.get(str(path))
        if prev is not None and prev["size"] == st.st_size and prev["sha256"] == sha:
            continue
        entry = {"path": str(path), "size": st.st_size, "sha256": sha, "mtime": st.st_mtime}
        if prev is not None:
            entry["status"] = "rewritten"
            entry["previous"] = {"size": prev["size"], "sha256": prev["sha256"], "cycle": prev.get("cycle")}
        elif sha in known_hashes and known_hashes[sha] != str(path):
            entry["status"] = "duplicate_content"
            entry["duplicate_of"] = known_hashes[sha]
        elif sha in seen_now:
            entry["status"] = "duplicate_content"
            entry["duplicate_of"] = seen_now[sha]
        else:
            entry["status"] = "new"
        seen_now.setdefault(sha, str(path))
        out.append(entry)
    return out


def unchanged(entry: dict) -> str | None:
    """None if the pinned file is still the same bytes, else why not."""
    path = Path(entry["path"])
    if not path.exists():
        return f"{path} disappeared"
    if path.stat().st_size != entry["size"]:
        return f"{path} changed size"
    if sha256_file(path) != entry["sha256"]:
        return f"{path} changed content"
    return None


def session_roots(records, remembered: dict[str, Any]) -> dict[str, str]:
    """session id -> root session id. A session's parent is the session of the request its
    ``parent_request_id`` names when that request is in another session (a sub-agent's first request),
    else ``metadata.parent_session_id`` when logged, else a link remembered from an earlier cycle."""
    session_of = {r.request_id: r.session_id for r in records}
    parent: dict[str, str] = {}
    for r in records:
        link = session_of.get(r.parent_request_id) if r.parent_request_id else None
        if link is None or link == r.session_id:
            hint = r.metadata.get("parent_session_id") if isinstance(r.metadata, dict) else None
            link = hint if isinstance(hint, str) and hint and hint != r.session_id else None
        if link is not None:
            parent.setdefault(r.session_id, link)
    for sid in {r.session_id for r in records}:
        if sid not in parent and sid in remembered:
            parent[sid] = remembered[sid][0]

    def root(sid: str) -> str:
        seen = {sid}
        while sid in parent and parent[sid] not in seen:
            sid = parent[sid]
            seen.add(sid)
        return sid

    return {sid: root(sid) for sid in {r.session_id for r in records}}


def is_heldout(root_session_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(b"dflash-retrain-heldout\0" + root_session_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def shuffle_tokens(dataset, seed: int):
    """Permute the tokens of every sequence (a training-data transform that destroys what can be learned)."""
    import numpy as np

    def permute(row, idx):
        ids = np.asarray(row["input_ids"])
        rng = np.random.default_rng([seed, idx])
        return {"input_ids": ids[rng.permutation(ids.shape[0])].tolist()}

    return dataset.map(permute, with_indices=True, desc="shuffle training tokens")


# --------------------------------------------------------------------------------------------------
# Drafters and versions
# --------------------------------------------------------------------------------------------------


def _initial_drafter(config: PipelineConfig, target_path: Path, target_config, out: Path, log) -> str:
    import torch

    from drafters.checkpoint import find_drafter_folder, load_drafter, save_drafter
    from drafters.model import DFlashDrafter
    from train.setup import build_draft_config

    rc = config.retrain
    if rc.initial_drafter:
        src = find_drafter_folder(rc.initial_drafter)
        load_drafter(src, target_config=target_config)  # refuses a drafter that does not fit the target
        copy_tree_atomic(src, out)
        return str(src)
    draft_config = build_draft_config(config, target_path, target_config)
    torch.manual_seed(config.train.seed)
    save_drafter(DFlashDrafter(draft_config), out, dtype=torch.bfloat16)
    make_readable(out)
    log(f"[retrain] no retrain.initial_drafter: starting from a random drafter ({draft_config.num_hidden_layers} "
        f"layer(s), target layers {draft_config.dflash_config['target_layer_ids']})")
    return "random init (drafter section, seed train.seed)"


def _export_all(config: PipelineConfig, drafter_dir: Path, version_dir: Path, card: dict) -> dict:
    from drafters.export import export_drafter

    rc = config.retrain
    out = {}
    for dtype in rc.export_dtypes:
        summary = export_drafter(drafter_dir, version_dir / dtype, dtype, model_card_info=card, overwrite=True,
                                 allow_unaligned=rc.export_allow_unaligned)
        out[dtype] = {"path": str(version_dir / dtype), "weights_bytes": summary["weights_bytes"],
                      "fp8_alignment_problems": summary.get("fp8_alignment_problems", [])}
    return out


def check_exportable(config: PipelineConfig, drafter_dir: Path) -> None:
    """Refuse (before any work) an FP8 export that export_drafter would refuse after training."""
    from drafters import contract

    rc = config.retrain
    if "fp8" in rc.export_dtypes and not rc.export_allow_unaligned:
        problems = contract.fp8_alignment_problems(json.loads((drafter_dir / "config.json").read_text()))
        if problems:
            raise RetrainError("retrain.export_dtypes includes fp8 but the drafter's widths are not FP8-block "
                               f"aligned: {problems}; set retrain.export_allow_unaligned=true (not servable by "
                               "SGLang's block-FP8 kernels) or drop fp8 from retrain.export_dtypes")


def bootstrap(config: PipelineConfig, sd: StateDir, state: dict, target_path: Path, target_config, log) -> None:
    """First run: install the initial drafter as versions/v0000 and point ``current`` at it."""
    if state["versions"]:
        return
    version = "v0000"
    vdir = sd.version_dir(version)
    if vdir.exists():
        shutil.rmtree(vdir)  # left by a run killed before it committed the bootstrap
    source = _initial_drafter(config, target_path, target_config, vdir / "drafter", log)
    check_exportable(config, vdir / "drafter")
    exports = _export_all(config, vdir / "drafter", vdir,
                          {"target": str(target_path), "data": f"initial drafter ({source})"})
    info = {"version": version, "cycle": 0, "created": now_iso(), "source": source, "parent": None,
            "drafter": str(vdir / "drafter"), "exports": exports, "tau": None}
    write_json_atomic(vdir / "version.json", info)
    record = {"id": "bootstrap-v0000", "event": "bootstrap", "time": now_iso(), "version": version,
              "source": source}
    state["versions"][version] = {k: info[k] for k in ("cycle", "created", "source", "parent", "tau")}
    state["promoted"] = version
    state["last_record"] = record
    commit(sd, state)
    log(f"[retrain] bootstrap: {version} = {source}; {sd.current} -> {version}")


# --------------------------------------------------------------------------------------------------
# One cycle
# --------------------------------------------------------------------------------------------------


def _eval_settings(config: PipelineConfig, target_path: Path, heldout_files: list[str], out: Path):
    from eval.acceptance import EvalSettings

    rc = config.retrain
    return EvalSettings(
        target=str(target_path), cache_dir=config.cache_dir, dtype=rc.eval_dtype, categories=["agentic"],
        agentic_log=list(heldout_files), agentic_per_session=rc.eval_requests_per_session,
        max_prompts=rc.eval_max_prompts, max_new_tokens=rc.eval_max_new_tokens, max_tokens=rc.eval_max_tokens,
        temperature=0.0, reference_subset=0, simulate=False, warmup=False, out=str(out), wandb=False,
        trust_remote_code=config.target.trust_remote_code, thinking=config.data.thinking)


def _wandb_log(config: PipelineConfig, sd: StateDir, record: dict, log) -> None:
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


def _commit(config: PipelineConfig, sd: StateDir, state: dict, record: dict, files: list[dict], *, consume: bool,
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
        _wandb_log(config, sd, record, log)
    except Exception as err:  # metrics must never undo a committed cycle
        log(f"[retrain] wandb logging failed: {type(err).__name__}: {err}")
    return record


def _summary_line(record: dict) -> str:
    status, c = record["status"], record["cycle"]
    if status == "no_new_data":
        return f"[retrain] cycle {c}: no new data under {record['incoming']}; nothing to do (no training, no promotion)"
    head = f"[retrain] cycle {c}: {status}"
    if record.get("tau_candidate") is not None:
        head += (f"; tau current {record['current_version']} {record['tau_current']:.3f} -> candidate "
                 f"{record['tau_candidate']:.3f}")
    return f"{head}. {record['reason']}"


def run_cycle(config: PipelineConfig, log=print) -> dict:
    """Run one retraining cycle under the state-dir lock; returns the committed history record."""
    rc = config.retrain
    if not rc.incoming:
        raise RetrainError("retrain.incoming lists no folder or file to read new trajectory logs from")
    sd = StateDir(rc.state_dir)
    with state_lock(sd):
        state = load_state(sd)
        repair(sd, state, log)
        return _run_cycle_locked(config, sd, state, log)


def _run_cycle_locked(config: PipelineConfig, sd: StateDir, state: dict, log) -> dict:
    from drafters.draft_config import text_config
    from drafters.target_loading import load_target_config
    from train.setup import resolve_target

    rc = config.retrain
    started = time.time()
    phase: dict[str, float] = {}
    target_path = resolve_target(config, log)
    target_config = load_target_config(target_path, config.target.trust_remote_code)
    vocab_size = int(text_config(target_config).vocab_size)
    bootstrap(config, sd, state, target_path, target_config, log)
    current_version = state["promoted"]
    current_drafter = sd.version_dir(current_version) / "drafter"
    check_exportable(config, current_drafter)

    # ---- which files: a killed cycle's pinned set, or everything new -------------------------------
    ip = state.get("in_progress")
    if ip is not None:
        why = next((w for w in map(unchanged, ip["files"]) if w), None)
        if why is None and ip.get("current_version") != current_version:
            why = f"the promoted version changed from {ip.get('current_version')} to {current_version} (rollback)"
        if why is None:
            log(f"[retrain] resuming interrupted cycle {ip['cycle']} ({len(ip['files'])} file(s), started {ip['started']})")
        else:
            log(f"[retrain] discarding interrupted cycle {ip['cycle']}: {why}; starting it afresh")
            shutil.rmtree(sd.cycle_dir(ip["cycle"]), ignore_errors=True)
            ip = None
    if ip is None:
        t0 = time.time()
        files = discover(rc.incoming, state, sd)
        phase["discover"] = time.time() - t0
        cycle = state["cycle"] + 1
        if not files:
            record = {"id": f"cycle-{cycle:06d}", "event": "cycle", "cycle": cycle, "status": "no_new_data",
                      "reason": "no new or rewritten log file since the last cycle", "started": now_iso(),
                      "finished": now_iso(), "incoming": rc.incoming, "current_version": current_version,
                      "promoted_version": None, "promoted": False, "tau_current": None, "tau_candidate": None,
                      "files": [], "seconds": {"total": round(time.time() - started, 3)}}
            _commit(config, sd, state, record, [], consume=False, log=log)
            log(_summary_line(record))
            return record
        ip = {"cycle": cycle, "started": now_iso(), "files": files, "current_version": current_version}
        state["in_progress"] = ip
        save_state(sd, state)
    cycle, files = ip["cycle"], ip["files"]
    cdir = sd.cycle_dir(cycle)
    cdir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "id": f"cycle-{cycle:06d}", "event": "cycle", "cycle": cycle, "status": None, "reason": None,
        "started": ip["started"], "finished": None, "incoming": rc.incoming, "cycle_dir": str(cdir),
        "current_version": current_version, "promoted_version": None, "promoted": False,
        "tau_current": None, "tau_candidate": None}

    # ---- 1. ingest ---------------------------------------------------------------------------------
    from data.prefix_tree import build_prefix_tree
    from data.trajectories import TrajectoryReader, content_key

    t0 = time.time()
    to_read = [f["path"] for f in files if f["status"] != "duplicate_content"]
    quarantine = cdir / "quarantine.jsonl"
    records = []
    summary = None
    if to_read:
        earlier = {key: f"cycle {c}" for key, c in state["requests"].items()}
        reader = TrajectoryReader(to_read, vocab_size, quarantine_path=quarantine, already_consumed=earlier,
                                  max_record_bytes=config.data.max_record_bytes)
        records = list(reader)
        summary = reader.summary.check()
        write_json_atomic(cdir / "ingest_summary.json", summary.to_dict())
    per_file = []
    for f in files:
        counts = summary.files.get(f["path"]) if summary is not None else None
        entry = {"path": f["path"], "size": f["size"], "sha256": f["sha256"], "arrival": f["status"]}
        if counts is not None:
            entry.update(read=counts.read, accepted=counts.accepted, quarantined=counts.quarantined)
            entry["status"] = "ingested" if counts.accepted else ("quarantined_only" if counts.quarantined else "empty")
        else:
            entry.update(read=0, accepted=0, quarantined=0)
            entry["status"] = "duplicate_content" if f["status"] == "duplicate_content" else "empty"
        if f["status"] == "rewritten":
            log(f"[retrain] WARNING: {f['path']} was consumed in cycle {f['previous']['cycle']} and has been rewritten "
                "since; it is read again in full (the requests it held before are quarantined as already_consumed). "
                "Rotate log files instead of rewriting them (data/TRAJECTORY_FORMAT.md).")
        per_file.append(entry)
    record["files"] = per_file
    record["requests"] = {
        "read": summary.read if summary else 0, "accepted": summary.accepted if summary else 0,
        "quarantined": summary.quarantined if summary else 0,
        "by_reason": dict(sorted(summary.by_reason.items())) if summary else {},
        "blank_lines": summary.blank_lines if summary else 0}
    record["file_counts"] = dict(Counter(e["status"] for e in per_file))
    record["quarantine_file"] = str(quarantine) if summary is not None else None
    phase["ingest"] = time.time() - t0
    log(f"[retrain] cycle {cycle}: {len(files)} new file(s) {record['file_counts']}; requests read "
        f"{record['requests']['read']}, accepted {record['requests']['accepted']}, quarantined "
        f"{record['requests']['quarantined']} {record['requests']['by_reason']}"
        + (f" (quarantine: {quarantine})" if record["requests"]["quarantined"] else ""))

    def finish(status: str, reason: str, *, consume: bool = True, roots=None, version=None) -> dict:
        record["status"], record["reason"] = status, reason
        record["finished"] = now_iso()
        phase["total"] = time.time() - started
        record["seconds"] = {k: round(v, 3) for k, v in phase.items()}
        write_json_atomic(cdir / "cycle.json", record)
        _commit(config, sd, state, record, files, consume=consume, roots=roots, version=version,
                requests=[content_key(r) for r in records], log=log)
        log(_summary_line(record))
        return record

    if not records:
        if record["requests"]["quarantined"]:
            return finish("quarantined_only", f"all {record['requests']['quarantined']} request(s) of the new file(s) "
                          f"were quarantined (see {quarantine}); the files are marked consumed and not read again")
        return finish("no_records", "the new file(s) hold no request (empty or duplicate content); marked consumed")

    # ---- 2. held-out split (before training sees anything) ------------------------------------------
    roots = session_roots(records, state["session_roots"])
    heldout = [r for r in records if is_heldout(roots[r.session_id], rc.heldout_fraction)]
    held_ids = {r.request_id for r in heldout}
    train_records = [r for r in records if r.request_id not in held_ids]
    heldout_file = cdir / "heldout.jsonl.gz"
    if heldout and not heldout_file.exists():
        from data.trajectories import write_trajectories

        write_trajectories(heldout, heldout_file)
    record["split"] = {
        "heldout_fraction": rc.heldout_fraction,
        "sessions": len(roots), "root_sessions": len(set(roots.values())),
        "sub_sessions_following_parent": sum(1 for s, r in roots.items() if s != r),
        "train_sessions": len({r.session_id for r in train_records}),
        "heldout_sessions": len({r.session_id for r in heldout}),
        "train_requests": len(train_records), "heldout_requests": len(heldout),
        "heldout_file": str(heldout_file) if heldout else None}
    record["heldout_file"] = str(heldout_file) if heldout else None
    window = ([str(heldout_file)] if heldout else []) + [
        c for c in (_cycle_heldout(sd, e) for e in reversed(state["cycles"])) if c][: rc.heldout_window - (1 if heldout else 0)]
    record["split"]["gate_heldout_files"] = window
    log(f"[retrain] split: {record['split']['train_sessions']} training session(s) / {len(train_records)} request(s), "
        f"{record['split']['heldout_sessions']} held-out session(s) / {len(heldout)} request(s); the gate reads "
        f"{len(window)} held-out file(s)")

    if not train_records:
        return finish("no_training_data", "every new request belongs to a held-out session; nothing to train on "
                      "(the held-out requests join the gate's window)", roots=roots)
    if not window:
        return finish("deferred_no_heldout", "no held-out traffic in this cycle or the window to evaluate a candidate "
                      "on; the files are NOT consumed and are read again, with newer ones, next cycle",
                      consume=False)

    # ---- 3. dedup -> dataset -> fine-tune ------------------------------------------------------------
    t0 = time.time()
    tree = build_prefix_tree(train_records)
    stats = tree.stats()
    record["tokens"] = {
        "logged": int(sum(r.num_tokens for r in records)),
        "logged_train": stats.logged_tokens, "logged_output_train": stats.logged_output_tokens,
        "unique_train": stats.unique_tokens, "unique_generated_train": stats.unique_generated_tokens,
        "dedup_ratio": round(stats.dedup_ratio, 4), "tree_leaves": stats.leaves,
        "logged_heldout": int(sum(r.num_tokens for r in heldout))}
    dataset_dir = cdir / "dataset"
    if not (dataset_dir / "dataset_info.json").exists():
        dataset = tree.to_dataset(max_seq_len=config.data.max_seq_len)
        if rc.shuffle_training_tokens:
            dataset = shuffle_tokens(dataset, config.data.seed + cycle)
        with atomic_folder(dataset_dir) as tmp:
            dataset.save_to_disk(str(tmp))
    from datasets import load_from_disk

    from train.batches import DatasetError, check_training_dataset

    dataset = load_from_disk(str(dataset_dir))
    record["dataset"] = {"path": str(dataset_dir), "rows": len(dataset),
                         "tokens": int(sum(len(x) for x in dataset["input_ids"])),
                         "loss_tokens": int(sum(sum(m) for m in dataset["loss_mask"])),
                         "shuffled_tokens": rc.shuffle_training_tokens}
    log(f"[retrain] dedup: {stats.logged_tokens} logged training tokens -> {stats.unique_tokens} unique "
        f"({stats.dedup_ratio:.2f}x), {len(dataset)} sequence(s), {record['dataset']['loss_tokens']} loss tokens"
        + (" [tokens SHUFFLED: retrain.shuffle_training_tokens]" if rc.shuffle_training_tokens else ""))
    try:
        check_training_dataset(dataset, str(dataset_dir), config.data.max_seq_len)
    except DatasetError as err:
        return finish("no_training_data", f"the training requests give nothing to train on: {err}", roots=roots)
    phase["dataset"] = time.time() - t0

    t0 = time.time()
    done_marker = cdir / "train_done.json"
    if done_marker.exists():
        done = json.loads(done_marker.read_text())
        log(f"[retrain] training of cycle {cycle} already finished: {done['drafter']}")
    else:
        from train.checkpointing import latest_checkpoint, read_trainer_state
        from train.dflash import train

        tcfg = config.model_copy(deep=True)
        tcfg.run_name = f"{config.run_name}-retrain-cycle{cycle:04d}"
        tcfg.output_dir = str(cdir / "train")
        tcfg.target.path = str(target_path)
        tcfg.data.dataset = str(dataset_dir)
        tcfg.data.trajectories = []
        tcfg.train.stage = "finetune"
        tcfg.train.init_from = str(current_drafter)
        tcfg.train.resume = True
        if config.features.mode == "offline":  # this cycle's feature cache lives (and dies) with the cycle
            tcfg.cache_dir = str(cdir / "feature-cache")
        log(f"[retrain] fine-tuning {current_version} -> candidate in {tcfg.output_dir}")
        drafter_dir = train(tcfg)
        last = latest_checkpoint(tcfg.output_dir)
        done = {"drafter": str(drafter_dir), "step": read_trainer_state(last).step,
                "metrics": read_trainer_state(last).metrics, "init_from": str(current_drafter)}
        write_json_atomic(done_marker, done)
    candidate = Path(done["drafter"])
    if (cdir / "train" / "feature_capture.json").exists():  # offline features: what the target ran for this cycle
        record["features"] = json.loads((cdir / "train" / "feature_capture.json").read_text())
    record["train"] = {"init_from": done["init_from"], "steps": done["step"], "final_metrics": done["metrics"],
                       "output_dir": str(cdir / "train")}
    phase["train"] = time.time() - t0

    # ---- 4. evaluate current and candidate on the same held-out traffic -----------------------------
    t0 = time.time()
    eval_dir = cdir / "eval"
    report = None
    if (eval_dir / "report.json").exists():
        report = json.loads((eval_dir / "report.json").read_text())
        names = {d["name"]: d["folder"] for d in report.get("drafters", [])}
        if names != {"current": str(current_drafter), "candidate": str(candidate)}:
            report = None
    if report is None:
        from eval.acceptance import evaluate

        report = evaluate([f"current={current_drafter}", f"candidate={candidate}"],
                          _eval_settings(config, target_path, window, eval_dir), log=log)
    cat = report["categories"]["agentic"]
    methods = cat["methods"]
    cur, cand, lookup = methods["current"], methods["candidate"], methods.get("prompt_lookup", {})
    tau_cur, tau_cand = cur["tau_mean"], cand["tau_mean"]
    record["tau_current"], record["tau_candidate"] = tau_cur, tau_cand
    record["eval"] = {
        "prompts": cat["prompts"], "prompt_tokens": cat["prompt_tokens"], "heldout_files": window,
        "max_new_tokens": rc.eval_max_new_tokens, "tau_current": tau_cur, "tau_candidate": tau_cand,
        "tau_prompt_lookup": lookup.get("tau_mean"),
        "tau_gain": (tau_cand / tau_cur - 1.0) if tau_cur and tau_cand is not None else None,
        "mismatched_current": cur.get("mismatched", 0), "mismatched_candidate": cand.get("mismatched", 0),
        "mismatches": report.get("mismatches", []), "report": str(eval_dir / "report.json")}
    phase["eval"] = time.time() - t0
    if report.get("mismatches"):
        log(f"[retrain] WARNING: T=0 output mismatches vs the target's greedy output: {report['mismatches']}")

    # ---- 5. gate, export, promote --------------------------------------------------------------------
    margin = rc.promotion_margin
    required = tau_cur * (1.0 + margin) if tau_cur is not None else None
    record["gate"] = {"margin": margin, "required_tau": required}
    if tau_cand is None or tau_cur is None:
        return _not_promoted(finish, sd, cdir, candidate, config, "no decode step was measured on the held-out traffic", roots)
    if rc.require_identical_outputs and cand.get("mismatched", 0):
        return _not_promoted(finish, sd, cdir, candidate, config,
                             f"the candidate's greedy output differs from the target's on {cand['mismatched']} held-out "
                             "prompt(s) (retrain.require_identical_outputs)", roots)
    if not tau_cand > required:
        return _not_promoted(finish, sd, cdir, candidate, config,
                             f"candidate tau {tau_cand:.3f} does not beat current {current_version} tau {tau_cur:.3f} by "
                             f"the margin {margin:.1%} (needs > {required:.3f}); {current_version} stays current", roots)
    if rc.serving_check:  # the engine must serve the candidate as the decoder measured it (eval/engine.py)
        from drafters.export import export_drafter
        from eval.engine import serving_check

        export_drafter(candidate, cdir / "serving-check" / "bf16", "bf16", overwrite=True)
        check = serving_check(cdir / "serving-check" / "bf16", _eval_settings(config, target_path, window,
                                                                             cdir / "serving-check"), log=log)
        record["serving_check"] = {k: check[k] for k in ("passed", "identical", "prompts", "tau_engine", "tau_decoder")}
        if not check["passed"]:
            return _not_promoted(finish, sd, cdir, candidate, config, "the candidate's bf16 export failed the vLLM "
                                 f"serving check ({cdir / 'serving-check' / 'serving_check.json'})", roots)

    t0 = time.time()
    version = next_version(state)
    vdir = sd.version_dir(version)
    if vdir.exists():
        shutil.rmtree(vdir)  # built by a run killed before its commit: not referenced by the state
    copy_tree_atomic(candidate, vdir / "drafter")
    card = {"target": str(target_path), "tau": {"agentic_heldout": round(tau_cand, 4)},
            "data": f"retrain cycle {cycle}: fine-tuned from {current_version} on {len(train_records)} logged requests "
                    f"({stats.unique_tokens} unique tokens)"}
    exports = _export_all(config, vdir / "drafter", vdir, card)
    copy_tree_atomic(eval_dir, vdir / "eval")
    info = {"version": version, "cycle": cycle, "created": now_iso(), "source": f"retrain cycle {cycle}",
            "parent": current_version, "drafter": str(vdir / "drafter"), "exports": exports, "tau": tau_cand,
            "tau_parent": tau_cur, "heldout_files": window}
    write_json_atomic(vdir / "version.json", info)
    phase["export"] = time.time() - t0
    record["promoted"], record["promoted_version"] = True, version
    record["exports"] = exports
    gain = tau_cand / tau_cur - 1.0
    return _cleanup_after(cdir, config, finish(
        "promoted", f"candidate tau {tau_cand:.3f} beats {current_version} tau {tau_cur:.3f} by {gain:+.1%} "
        f"(margin {margin:.1%}); {version} is now current", roots=roots,
        version=(version, {k: info[k] for k in ("cycle", "created", "source", "parent", "tau")})))


def _cycle_heldout(sd: StateDir, entry: dict) -> str | None:
    path = sd.cycle_dir(int(entry["cycle"])) / "heldout.jsonl.gz"
    return str(path) if entry.get("status") not in (None, "no_new_data", "deferred_no_heldout") and path.exists() else None


def _not_promoted(finish, sd: StateDir, cdir: Path, candidate: Path, config: PipelineConfig, reason: str, roots) -> dict:
    kept = cdir / "candidate"
    if not kept.exists():
        copy_tree_atomic(candidate, kept)
    return _cleanup_after(cdir, config, finish("not_promoted", reason + f" (candidate kept in {kept})", roots=roots))


def _cleanup_after(cdir: Path, config: PipelineConfig, record: dict) -> dict:
    """After the commit: drop the cycle's feature cache, and its training checkpoints (optimizer state)
    unless asked to keep them."""
    shutil.rmtree(cdir / "feature-cache", ignore_errors=True)
    if not config.retrain.keep_checkpoints:
        shutil.rmtree(cdir / "train" / "checkpoints", ignore_errors=True)
    return record


# --------------------------------------------------------------------------------------------------
# Rollback and status
# --------------------------------------------------------------------------------------------------


def rollback(config: PipelineConfig, version: str, log=print) -> dict:
    sd = StateDir(config.retrain.state_dir)
    with state_lock(sd):
        state = load_state(sd)
        repair(sd, state, log)
        if version not in state["versions"]:
            raise RetrainError(f"no version {version!r} in {sd.state}; known: {sorted(state['versions'])}")
        if not (sd.version_dir(version) / "drafter" / "config.json").is_file():
            raise RetrainError(f"{sd.version_dir(version)} holds no drafter; cannot roll back to it")
        previous = state["promoted"]
        n = sum(1 for r in read_jsonl(sd.history) if r.get("event") == "rollback") + 1
        record = {"id": f"rollback-{n:04d}", "event": "rollback", "time": now_iso(), "cycle": state["cycle"],
                  "from_version": previous, "to_version": version}
        state["promoted"] = version
        state["last_record"] = record
        commit(sd, state)
        log(f"[retrain] rollback: {sd.current} -> {version} (was {previous}); the next cycle fine-tunes {version}")
        return record


def status(config: PipelineConfig) -> dict:
    sd = StateDir(config.retrain.state_dir)
    state = load_state(sd)
    return {"state_dir": str(sd.root), "cycle": state["cycle"], "promoted": state["promoted"],
            "current_link": os.readlink(sd.current) if sd.current.is_symlink() else None,
            "versions": state["versions"], "consumed_files": len(state["consumed"]),
            "consumed_requests": len(state["requests"]),
            "in_progress": state["in_progress"], "last_cycles": state["cycles"][-5:]}


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/retrain-testbed.yaml", help="pipeline YAML with a retrain section")
    parser.add_argument("--rollback", metavar="VERSION", default=None, help="point `current` at an earlier version and exit")
    parser.add_argument("--status", action="store_true", help="print the state summary as JSON and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. retrain.promotion_margin=0.05")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.status:
            print(json.dumps(status(config), indent=2, default=str))
        elif args.rollback:
            rollback(config, args.rollback)
        else:
            run_cycle(config)
    except Busy as err:
        print(f"[retrain] {err}", file=sys.stderr)
        return EXIT_BUSY
    except (ConfigError, RetrainError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        from train.dflash import EXIT_DIVERGED, TrainingDiverged

        if not isinstance(err, TrainingDiverged):
            raise
        print(f"error: {err} (the cycle stays in progress and resumes from that checkpoint)", file=sys.stderr)
        return EXIT_DIVERGED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
