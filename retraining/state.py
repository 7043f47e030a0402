"""The retraining state directory: its layout, the state file (the truth) and what follows it.

``state.json`` is only ever replaced whole (atomic rename); the ``current`` symlink and ``history.jsonl``
follow it, and ``repair`` finishes what a run killed between those steps left undone. See scripts/RETRAIN.md
for the layout and the state file format.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
from pathlib import Path

from common.atomic_files import (
    atomic_folder,
    fsync_dir,
    make_readable,
    write_json_atomic,
)
from common.locks import FileLock

STATE_FORMAT = 1


class RetrainError(ValueError):
    """A configuration or state problem that stops the cycle before it changes anything."""


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
