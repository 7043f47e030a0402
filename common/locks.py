"""One lock: flock on a file. The kernel releases it when the holder dies (even by SIGKILL), so a killed job
never leaves a stale lock behind, and a second process is refused at once instead of waiting."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


class Busy(RuntimeError):
    """Another process holds the lock."""


class FileLock:
    """`with FileLock(path, "another cycle is running"):` — while another process holds it, entering raises
    Busy with that message, the lock file and the holder's process id."""

    def __init__(self, path: Path, busy_message: str = "another process holds the lock"):
        self.path = Path(path)
        self.busy_message = busy_message
        self.fd: int | None = None

    def __enter__(self) -> "FileLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(self.fd)
            self.fd = None
            if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise Busy(f"{self.busy_message} ({self.path} is held by process {self._holder()})") from None
            raise
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())
        return self

    def _holder(self) -> str:
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
