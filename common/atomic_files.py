"""Atomic file and folder writes: a reader (or a crash) sees the old file or folder or the new one, never half
of one. Each is built under a temporary name in the destination's folder, fsynced, moved into place with
os.replace, and the folder fsynced so the rename survives a power cut."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


def fsync_dir(folder: Path) -> None:
    """Make a rename inside folder durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path next to `path` for a writer that wants a file name (safetensors, parquet); when the
    block completes the file is fsynced, made 0644 and moved to `path`. A failed block leaves nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator[IO]:
    """Write `path` through a file object ("wb", or "w" for UTF-8 text); it appears only if the block completes."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj: Any, *, compact: bool = False) -> None:
    if compact:
        text = json.dumps(obj, separators=(",", ":"), default=str)
    else:
        text = json.dumps(obj, indent=2, default=str) + "\n"
    write_text_atomic(path, text)


def replace_folder(new: Path, dst: Path) -> None:
    """Move the finished folder `new` to `dst`, replacing what is there: the old folder is first moved aside,
    so `dst` is at every moment either the old folder or the new one (and the old one comes back if the
    second rename fails)."""
    new, dst = Path(new), Path(dst)
    if not dst.exists() and not dst.is_symlink():
        os.replace(new, dst)
    else:
        aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old.", dir=dst.parent))
        os.replace(dst, aside / "x")
        try:
            os.replace(new, dst)
        except BaseException:
            os.replace(aside / "x", dst)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(dst.parent)


@contextmanager
def atomic_folder(dst: Path) -> Iterator[Path]:
    """Build a folder in the yielded (empty, existing) temporary folder next to `dst`; when the block completes
    it replaces `dst` (replace_folder). A failed block leaves `dst` as it was and nothing behind."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp.", dir=dst.parent))
    try:
        (holder / "x").mkdir()
        yield holder / "x"
        replace_folder(holder / "x", dst)
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def make_readable(root: Path) -> None:
    """mkdtemp folders are 0700: let a serving process under another user read what we publish."""
    for folder, _dirs, names in os.walk(root):
        os.chmod(folder, 0o755)
        for name in names:
            os.chmod(os.path.join(folder, name), 0o644)
