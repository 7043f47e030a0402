"""What a target computes, as one content hash: the key of every cache built from the target.

The regenerated mixture, the feature cache and regeneration's resumable state are keyed on this
fingerprint, not on the target's path, so a target whose weights, tokenizer or chat template change in
place (even one tensor, with the file's size and mtime restored) gets new data and new features.

Two modes (`target.fingerprint`):
- "content" (default): sha256 of every file in the folder but documentation, files hashed in parallel
  threads, once per process: the testbed's 260 MB in 0.75 s on this 2-core CPU; a 1 TB target is bound by
  disk reads (about 5 minutes at 3.5 GB/s, when cores keep up: sha256 runs at 0.35-2 GB/s per core).
- "sidecar": for multi-terabyte targets. The per-file hashes are read from `dflash-fingerprint.json`
  beside the weights, written once by `dflash-pipeline fingerprint TARGET --write` (or by
  whatever publishes the weights). Only the file list and sizes are checked at run time, so whoever
  changes a file in place must rewrite the sidecar: that is the price of not reading the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.atomic_files import write_json_atomic

SIDECAR = "dflash-fingerprint.json"
# Files that do not change what the target computes. testbed_verified.json is the testbed's own receipt.
IGNORED_SUFFIXES = (".md", ".txt", ".lock")
IGNORED_NAMES = {SIDECAR, ".gitattributes", "LICENSE", "testbed_verified.json"}
CHUNK = 16 << 20

_memo: dict[tuple, str] = {}


class FingerprintError(ValueError):
    """A sidecar that does not describe the folder beside it; the message names the file."""


def target_files(target_path: str | Path) -> list[Path]:
    """The files whose bytes define the target (weights, config, tokenizer, chat template), sorted."""
    root = Path(target_path)
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # .git, .cache (hub download state)
        found += [Path(folder) / name for name in files
                  if name not in IGNORED_NAMES and not name.startswith(".") and not name.endswith(IGNORED_SUFFIXES)]
    return sorted(found)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(target_path: str | Path) -> dict[str, dict]:
    """{relative path: {"size", "sha256"}} of the target's files, read in full."""
    root = Path(target_path)
    files = target_files(root)
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), os.cpu_count() or 1, 16))) as pool:
        digests = list(pool.map(file_sha256, files))  # hashlib releases the GIL on large blocks
    return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": d} for p, d in zip(files, digests)}


def _sidecar_hashes(root: Path) -> dict[str, dict]:
    path = root / SIDECAR
    if not path.is_file():
        raise FingerprintError(f"target.fingerprint is 'sidecar' but {path} does not exist; write it with "
                               f"`dflash-pipeline fingerprint {root} --write`")
    try:
        recorded = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise FingerprintError(f"{path} is not a fingerprint sidecar ({err})") from None
    present = {str(p.relative_to(root)): p.stat().st_size for p in target_files(root)}
    listed = {name: entry.get("size") for name, entry in recorded.items()}
    if present != listed:
        changed = sorted(k for k in present.keys() | listed.keys() if present.get(k) != listed.get(k))
        raise FingerprintError(f"{path} does not match the folder (files added, removed or resized: {changed[:5]}); "
                               f"rewrite it with `dflash-pipeline fingerprint {root} --write`")
    return recorded


def target_fingerprint(target_path: str | Path, mode: str = "content") -> str:
    """"blake2b-target:<hex>" over every target file's name, size and sha256."""
    root = Path(target_path).resolve()
    files = target_files(root)
    state = (str(root), mode, tuple((str(p), st.st_size, st.st_mtime_ns, st.st_ino)
                                    for p in files for st in [p.stat()]))
    if state not in _memo:
        hashes = file_hashes(root) if mode == "content" else _sidecar_hashes(root)
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(hashes):
            digest.update(f"{name}\0{hashes[name]['size']}\0{hashes[name]['sha256']}\n".encode())
        _memo[state] = "blake2b-target:" + digest.hexdigest()
    return _memo[state]


def note_target(cache_root: Path, target_path: str | Path, fingerprint: str, log=print) -> bool:
    """Record the fingerprint seen at this path; says so (and returns True) when it differs from the last run's."""
    index_path = Path(cache_root) / "targets.json"
    try:
        index = json.loads(index_path.read_text()) if index_path.exists() else {}
    except ValueError:
        index = {}
    key = str(Path(target_path).resolve())
    previous = index.get(key)
    if previous == fingerprint:
        return False
    if previous is not None:
        log(f"[target] {key} changed since the last run here (content {previous} -> {fingerprint}): its regenerated "
            "data and feature caches are recomputed for the new content (the old ones stay under their own key)")
    index[key] = fingerprint
    index_path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(index_path, index)
    return previous is not None


def write_sidecar(target: Path) -> Path:
    """Hash every file of the target folder once and write the sidecar beside them; returns its path."""
    write_json_atomic(Path(target) / SIDECAR, {"files": file_hashes(Path(target))})
    return Path(target) / SIDECAR
