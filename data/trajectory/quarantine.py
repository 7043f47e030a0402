"""What ingestion could not use: one quarantine item per line, row or unreadable chunk, the quarantine file, and
the counts that must reconcile (``read == accepted + quarantined``, globally, per reason and per file)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.atomic_files import atomic_file


class ReconciliationError(RuntimeError):
    """Raised by :meth:`IngestSummary.check` when accepted + quarantined != read."""


@dataclass
class QuarantineItem:
    """One quarantined line, row or unreadable chunk (one line of the quarantine JSONL file)."""

    reason: str
    message: str
    source_file: str
    line: int | None = None  # 1-based JSONL line number (first lost line for a corrupt gzip stream)
    row: int | None = None  # 0-based Parquet row index within the file (first row of a bad row group)
    row_group: int | None = None
    byte_offset: int | None = None  # compressed offset where a gzip stream broke (start of the 1 MiB read chunk)
    lost_rows: int | None = None  # rows in an unreadable Parquet row group / file, when known
    request_id: str | None = None
    session_id: str | None = None
    raw: str | None = None  # the raw line / row as JSON, truncated to max_excerpt_chars
    raw_chars: int | None = None  # length of the untruncated raw text
    raw_truncated: bool = False
    consumed_in: str | None = None  # already_consumed: where the same request was consumed first

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class FileCounts:
    read: int = 0
    accepted: int = 0
    quarantined: int = 0
    blank_lines: int = 0


@dataclass
class IngestSummary:
    """Counts of one ingestion run. ``read == accepted + quarantined`` always (see module docstring)."""

    vocab_size: int | None = None
    read: int = 0
    accepted: int = 0
    quarantined: int = 0
    blank_lines: int = 0
    by_reason: Counter = field(default_factory=Counter)
    files: dict[str, FileCounts] = field(default_factory=dict)
    accepted_input_tokens: int = 0
    accepted_output_tokens: int = 0
    quarantine_path: str | None = None
    quarantine_lines_written: int = 0
    complete: bool = False  # True once the reader ran to the end (not stopped early)
    examples: list[QuarantineItem] = field(default_factory=list)  # the first few items, for display

    def reconciles(self) -> bool:
        try:
            self.check()
        except ReconciliationError:
            return False
        return True

    def check(self) -> "IngestSummary":
        """Raise :class:`ReconciliationError` unless every count adds up; returns self."""
        problems = []
        if self.accepted + self.quarantined != self.read:
            problems.append(f"accepted {self.accepted} + quarantined {self.quarantined} != read {self.read}")
        if sum(self.by_reason.values()) != self.quarantined:
            problems.append(f"sum of per-reason counts {dict(self.by_reason)} != quarantined {self.quarantined}")
        for name, fc in self.files.items():
            if fc.accepted + fc.quarantined != fc.read:
                problems.append(f"{name}: accepted {fc.accepted} + quarantined {fc.quarantined} != read {fc.read}")
        for attr in ("read", "accepted", "quarantined", "blank_lines"):
            total = sum(getattr(fc, attr) for fc in self.files.values())
            if total != getattr(self, attr):
                problems.append(f"per-file {attr} sum {total} != {attr} {getattr(self, attr)}")
        if self.quarantine_path is not None and self.quarantine_lines_written != self.quarantined:
            problems.append(
                f"quarantine file {self.quarantine_path} has {self.quarantine_lines_written} lines, "
                f"expected {self.quarantined}"
            )
        if problems:
            raise ReconciliationError("ingestion does not reconcile: " + "; ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "read": self.read,
            "accepted": self.accepted,
            "quarantined": self.quarantined,
            "blank_lines": self.blank_lines,
            "by_reason": dict(sorted(self.by_reason.items())),
            "accepted_input_tokens": self.accepted_input_tokens,
            "accepted_output_tokens": self.accepted_output_tokens,
            "files": {k: dataclasses.asdict(v) for k, v in self.files.items()},
            "quarantine_path": self.quarantine_path,
            "complete": self.complete,
            "reconciles": self.reconciles(),
        }


class QuarantineWriter:
    """Writes quarantine items as JSONL to a temporary file, moved onto ``path`` when closed."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = None if path is None else Path(path)
        self._fh = None
        self._file = None
        self.lines = 0
        if self.path is not None:
            self._file = atomic_file(self.path, "w")
            self._fh = self._file.__enter__()

    def write(self, item: QuarantineItem) -> None:
        if self._fh is not None:
            # ASCII: a request id holding a lone surrogate is still written (escaped), never an encode error
            self._fh.write(json.dumps(item.to_dict()) + "\n")
            self.lines += 1

    def close(self) -> None:
        if self._fh is not None:
            self._fh = None
            self._file.__exit__(None, None, None)
