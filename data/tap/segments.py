"""The log tap's storage: records appended to an open segment file, fsync'd one by one, closed by a rename.

    <out>/tap-<instance>-<n>.jsonl.open   the segment being written (readers skip it: not a .jsonl name)
    <out>/tap-<instance>-<n>.jsonl        closed segments: what stage 2 and retraining read
    <out>/tap-quarantine.ndjson           records that could not be written, each with its reason (not a .jsonl:
                                          the trajectory readers skip it)

A record is one JSON line, written and fsync'd before the request's record counts as logged, so a
SIGTERM loses nothing that was answered and a SIGKILL loses at most the requests in flight. A segment is
closed (renamed) when it holds `max_records` records or `max_bytes` bytes, and on shutdown. On start, a
segment left open by a killed tap has its torn last line cut off and is closed.

Retention: closed segments older than `retention_seconds`, and then the oldest while the folder holds more
than `quota_bytes`, are deleted as segments close (None: kept).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

from common.atomic_files import fsync_dir
from data.trajectory.records import InvalidRecord, validate_record

OPEN_SUFFIX = ".jsonl.open"
QUARANTINE = "tap-quarantine.ndjson"  # not .jsonl: trajectory readers must not take it for traffic


def recover(out_dir: Path) -> list[Path]:
    """Close the segments a killed tap left open, cutting a torn last line; returns the closed paths."""
    closed = []
    for segment in sorted(Path(out_dir).glob(f"tap-*{OPEN_SUFFIX}")):
        data = segment.read_bytes()
        keep = data[: data.rfind(b"\n") + 1]  # whole lines only
        if len(keep) != len(data):
            with open(segment, "rb+") as f:
                f.truncate(len(keep))
                os.fsync(f.fileno())
        final = segment.with_name(segment.name.removesuffix(".open"))
        if keep:
            os.replace(segment, final)
            closed.append(final)
        else:
            segment.unlink()
    fsync_dir(Path(out_dir))
    return closed


class SegmentLog:
    """Thread-safe: append() from any thread; each call writes and fsyncs one line."""

    def __init__(self, out_dir: str | Path, instance: str, *, max_records: int = 10_000, max_bytes: int = 256 << 20,
                 retention_seconds: float | None = None, quota_bytes: int | None = None, vocab_size: int | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.instance, self.max_records, self.max_bytes = instance, max_records, max_bytes
        self.retention_seconds, self.quota_bytes, self.vocab_size = retention_seconds, quota_bytes, vocab_size
        self.recovered = recover(self.out_dir)
        self._lock = threading.Lock()
        self._file = None
        self._path: Path | None = None
        self._segments = 0
        self._in_segment = 0
        self.written = 0
        self.quarantined: Counter = Counter()

    @property
    def open_path(self) -> Path | None:
        return self._path

    def append(self, record: dict) -> bool:
        """Validate and write one record (True), or quarantine it with the reason (False). Never raises for a
        bad record, so one cannot block the ones after it."""
        try:
            line = json.dumps(validate_record(record, self.vocab_size, source="log tap").to_json_dict(),
                              separators=(",", ":"), ensure_ascii=False) + "\n"
        except InvalidRecord as err:
            self.quarantine(record, err.reason, str(err))
            return False
        data = line.encode("utf-8")
        with self._lock:
            try:
                if self._file is None:
                    self._open()
                self._file.write(data)
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as err:  # a full disk, say: the record is kept in quarantine if that can be written
                self._close_locked()
                self._quarantine_locked(record, "write_failed", f"{type(err).__name__}: {err}")
                return False
            self.written += 1
            self._in_segment += 1
            if self._in_segment >= self.max_records or self._file.tell() >= self.max_bytes:
                self._close_locked()
        return True

    def quarantine(self, record: dict, reason: str, message: str) -> None:
        with self._lock:
            self._quarantine_locked(record, reason, message)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _open(self) -> None:
        self._path = self.out_dir / f"tap-{self.instance}-{self._segments:06d}{OPEN_SUFFIX}"
        self._segments += 1
        self._file = open(self._path, "ab")
        self._in_segment = 0

    def _close_locked(self) -> None:
        if self._file is None:
            return
        self._file.close()
        final = self._path.with_name(self._path.name.removesuffix(".open"))
        os.replace(self._path, final)
        fsync_dir(self.out_dir)
        self._file, self._path = None, None
        self._apply_retention()

    def _quarantine_locked(self, record: dict, reason: str, message: str) -> None:
        self.quarantined[reason] += 1
        entry = {"reason": reason, "message": message, "time": time.time(),
                 "request_id": record.get("request_id") if isinstance(record, dict) else None,
                 "upstream_id": (record.get("metadata") or {}).get("upstream_id") if isinstance(record, dict) else None}
        try:
            with open(self.out_dir / QUARANTINE, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            pass  # counted; the reply to the client never depends on the log

    def _apply_retention(self) -> None:
        if self.retention_seconds is None and self.quota_bytes is None:
            return
        closed = sorted(self.out_dir.glob("tap-*.jsonl"),
                        key=lambda p: p.stat().st_mtime)
        now = time.time()
        if self.retention_seconds is not None:
            for path in [p for p in closed if now - p.stat().st_mtime > self.retention_seconds]:
                path.unlink(missing_ok=True)
                closed.remove(path)
        if self.quota_bytes is not None:
            total = sum(p.stat().st_size for p in closed)
            while closed and total > self.quota_bytes:
                oldest = closed.pop(0)
                total -= oldest.stat().st_size
                oldest.unlink(missing_ok=True)
