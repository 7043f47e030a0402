"""New traffic for a cycle: which log files are new (or rewritten), and the held-out split by root session."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from data.trajectory.reader import expand_paths
from retraining.state import RetrainError, StateDir, sha256_file


def discover(incoming: list[str], state: dict, sd: StateDir) -> list[dict]:
    """Files under ``incoming`` that are not consumed yet (new, or rewritten since), with their identity."""
    missing = [p for p in incoming if not Path(p).exists()]
    if missing:
        raise RetrainError(f"retrain.trajectories path(s) {missing} do not exist")
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
    def permute(row, idx):
        ids = np.asarray(row["input_ids"])
        rng = np.random.default_rng([seed, idx])
        return {"input_ids": ids[rng.permutation(ids.shape[0])].tolist()}

    return dataset.map(permute, with_indices=True, desc="shuffle training tokens")


def cycle_heldout_file(sd: StateDir, entry: dict) -> str | None:
    """The held-out file an earlier cycle wrote, if that cycle got as far as the split."""
    path = sd.cycle_dir(int(entry["cycle"])) / "heldout.jsonl.gz"
    return str(path) if entry.get("status") not in (None, "no_new_data", "deferred_no_heldout") and path.exists() else None
