"""Ingestion of logged production requests (trajectories) as token ids.

The contract with the serving side is ``data/TRAJECTORY_FORMAT.md``. In short: one record per request,
``session_id``, ``request_id``, ``input_ids``, ``output_ids``, ``timestamp`` required,
``parent_request_id`` and ``metadata`` optional; files are JSONL, JSONL.gz or Parquet.

:class:`TrajectoryReader` streams validated :class:`TrajectoryRecord` objects out of a list of files and
folders. Everything that cannot be used is *quarantined*, never silently dropped and never fatal: it is
written to a quarantine JSONL file (reason, source file, line or row, raw excerpt), counted per reason,
and the run continues. That holds for ANY exception while parsing or validating one record (an integer
literal over Python's 4,300-digit limit, nesting deeper than the parser's recursion limit, ...) and for a
line over ``max_record_bytes``, which is skipped without being held in memory. The :class:`IngestSummary`
always reconciles::

    read == accepted + quarantined

where ``read`` is defined precisely as

* every non-blank line of a JSONL / JSONL.gz file that could be decompressed
  (blank lines are counted separately in ``blank_lines`` and are not records),
* every row of a Parquet row group that could be decoded,
* plus ONE per unreadable chunk: a gzip stream that is truncated or corrupt from some offset on
  (the lines decompressed before that point are read normally; a partial line at the break belongs to
  the chunk), a file that cannot be opened or parsed at all, a Parquet row group that cannot be decoded.

:meth:`IngestSummary.check` raises :class:`ReconciliationError` when the counts do not add up
(globally, per reason, and per file).

:func:`write_trajectories` writes the same format atomically (temp file in the target folder, fsync,
``os.replace``), for the traffic simulator and the tests.

This module is the reader and the public face of ingestion; the pieces live next to it:
``data.trajectory.records`` (the record and its validation), ``data.trajectory.quarantine`` (quarantine items,
file and counts), ``data.trajectory.files`` (paths, formats, lines and rows) and ``data.trajectory.writer``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from data.trajectory.files import (
    GZIP_MAGIC,
    excerpt,
    expand_paths,
    file_format,
    gzip_lines,
    jsonable,
    plain_lines,
    table_rows,
)
from data.trajectory.quarantine import (
    FileCounts,
    IngestSummary,
    QuarantineItem,
    QuarantineWriter,
    ReconciliationError,
)
from data.trajectory.records import (
    MAX_INT32,
    OPTIONAL_FIELDS,
    REASONS,
    REQUIRED_FIELDS,
    InvalidRecord,
    TrajectoryRecord,
    content_key,
    record_where,
    validate_record,
)
from data.trajectory.writer import write_trajectories

__all__ = [
    "REQUIRED_FIELDS",
    "OPTIONAL_FIELDS",
    "REASONS",
    "TrajectoryRecord",
    "InvalidRecord",
    "ReconciliationError",
    "QuarantineItem",
    "IngestSummary",
    "TrajectoryReader",
    "validate_record",
    "content_key",
    "load_trajectories",
    "write_trajectories",
    "expand_paths",
]

DEFAULT_MAX_RECORD_BYTES = 64 << 20


def _parse_failure(e: BaseException) -> str:
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
        return "malformed_json"
    if isinstance(e, RecursionError):
        return "nesting_too_deep"
    if isinstance(e, ValueError) and "integer string conversion" in str(e):
        return "number_too_large"
    return "parse_error"


class TrajectoryReader:
    """Stream validated records from files/folders, quarantining everything unusable.

    >>> reader = TrajectoryReader(["logs/"], vocab_size=163840, quarantine_path="out/quarantine.jsonl")
    >>> for rec in reader: ...
    >>> reader.summary.check()

    Single use: iterate once. The quarantine file is written to a temp name and renamed onto
    ``quarantine_path`` when iteration ends (also when it is stopped early). Duplicate request ids are
    judged against the ids ACCEPTED so far in this run, across all files, in file order (sorted within a
    folder), then line / row order: the first valid occurrence wins.

    No single record can stop the run: any exception while parsing or validating one line or row
    quarantines it (``max_record_bytes`` bounds a JSONL line). ``already_consumed`` maps
    :func:`content_key` to where a request was consumed before (e.g. ``"cycle 3"``); such a request is
    quarantined as ``already_consumed`` naming that place.
    """

    def __init__(
        self,
        paths: Iterable[str | os.PathLike] | str | os.PathLike,
        vocab_size: int,
        *,
        quarantine_path: str | os.PathLike | None = None,
        max_excerpt_chars: int = 4096,
        keep_examples: int = 20,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        already_consumed: Mapping[str, str] | None = None,
    ):
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 0 < vocab_size <= MAX_INT32 + 1:
            raise ValueError(f"vocab_size must be a positive int <= 2**31, got {vocab_size!r}")
        self.files = expand_paths(paths)
        self.vocab_size = vocab_size
        self.max_excerpt_chars = max_excerpt_chars
        self.keep_examples = keep_examples
        self.summary = IngestSummary(
            vocab_size=vocab_size, quarantine_path=None if quarantine_path is None else str(quarantine_path)
        )
        self._quarantine_path = quarantine_path
        self._seen_ids: set[str] = set()
        self.max_record_bytes = max_record_bytes
        self.already_consumed = already_consumed or {}
        self._used = False

    # -- bookkeeping -------------------------------------------------------------------------------

    def _counts(self, src: str) -> FileCounts:
        return self.summary.files.setdefault(src, FileCounts())

    def _quarantine(self, q: QuarantineWriter, item: QuarantineItem) -> None:
        s = self.summary
        s.quarantined += 1
        s.by_reason[item.reason] += 1
        self._counts(item.source_file).quarantined += 1
        q.write(item)
        s.quarantine_lines_written = q.lines
        if len(s.examples) < self.keep_examples:
            s.examples.append(item)

    def _handle(self, q, src: str, obj: Any, raw_text, *, line=None, row=None) -> TrajectoryRecord | None:
        """Validate a parsed object; returns the record if accepted, else quarantines it."""
        where = f"{src}:{line}" if line is not None else f"{src}#row={row}"
        consumed_in = None
        try:
            rec = validate_record(obj, self.vocab_size, source=where)
            if rec.request_id in self._seen_ids:
                raise InvalidRecord(
                    "duplicate_request_id", f"{record_where(where, rec.request_id)}: request_id already accepted earlier"
                )
            key = content_key(rec)
            consumed_in = self.already_consumed.get(key)
            if consumed_in is not None:
                raise InvalidRecord(
                    "already_consumed", f"{record_where(where, rec.request_id)}: the same request (id and token ids) "
                    f"was already consumed by {consumed_in}"
                )
        except Exception as e:  # one record must never stop the run
            reason, message = (e.reason, e.message) if isinstance(e, InvalidRecord) else (
                "parse_error", f"{where}: {type(e).__name__} while validating: {str(e)[:500]}")
            text = raw_text() if callable(raw_text) else raw_text
            raw, n, trunc = excerpt(text, self.max_excerpt_chars)
            rid = obj.get("request_id") if isinstance(obj, Mapping) else None
            sid = obj.get("session_id") if isinstance(obj, Mapping) else None
            self._quarantine(
                q,
                QuarantineItem(
                    reason=reason,
                    message=message,
                    source_file=src,
                    line=line,
                    row=row,
                    request_id=rid if isinstance(rid, str) else None,
                    session_id=sid if isinstance(sid, str) else None,
                    consumed_in=consumed_in,
                    raw=raw,
                    raw_chars=n,
                    raw_truncated=trunc,
                ),
            )
            return None
        self._seen_ids.add(rec.request_id)
        s = self.summary
        s.accepted += 1
        s.accepted_input_tokens += int(rec.input_ids.size)
        s.accepted_output_tokens += int(rec.output_ids.size)
        self._counts(src).accepted += 1
        return rec

    # -- formats -----------------------------------------------------------------------------------

    def _read_jsonl(self, q, path: Path) -> Iterator[TrajectoryRecord]:
        src = str(path)
        fc = self._counts(src)
        try:
            with open(path, "rb") as f:
                magic = f.read(2)
        except OSError as e:
            self._unreadable(q, src, f"{src}: cannot open: {e}")
            return
        if file_format(path) == "jsonl.gz" and magic and magic != GZIP_MAGIC:
            self._count_read(fc)
            self._quarantine(q, QuarantineItem(
                reason="corrupt_compressed", source_file=src, line=1, byte_offset=0,
                message=f"{src}:1 (byte 0): not a gzip file (bad magic {magic!r}); nothing could be read"))
            return
        limit = self.max_record_bytes
        lines = gzip_lines(path, limit) if magic == GZIP_MAGIC else plain_lines(path, limit)
        lineno = 0
        try:
            for item in lines:
                if item[0] == "corrupt":
                    self._count_read(fc)
                    self._quarantine_corrupt(q, src, lineno, *item[1:])
                    return
                lineno += 1
                if item[0] == "oversized":
                    self._count_read(fc)
                    self._quarantine_oversized(q, src, lineno, *item[1:])
                    continue
                raw_line = item[1]
                if not raw_line.strip():
                    self.summary.blank_lines += 1
                    fc.blank_lines += 1
                    continue
                self._count_read(fc)
                try:
                    obj = json.loads(raw_line)
                except Exception as e:  # any failure of the JSON layer (digits, depth, ...) quarantines the line
                    self._quarantine_unparsed(q, src, lineno, raw_line, e)
                    continue
                rec = self._handle(q, src, obj, lambda: raw_line.decode("utf-8", "replace"), line=lineno)
                if rec is not None:
                    yield rec
        except OSError as e:  # I/O error in the middle of a file
            self._unreadable(q, src, f"{src}:{lineno + 1}: read error after {lineno} line(s): {e}", line=lineno + 1)

    def _count_read(self, fc: FileCounts) -> None:
        self.summary.read += 1
        fc.read += 1

    def _quarantine_corrupt(self, q, src: str, lineno: int, offset: int, msg: str, tail: bytes) -> None:
        """A gzip stream broken after ``lineno`` good lines: the rest of the file is one quarantined chunk."""
        raw, n, trunc = excerpt(tail.decode("utf-8", "replace"), self.max_excerpt_chars)
        self._quarantine(q, QuarantineItem(
            reason="corrupt_compressed", source_file=src, line=lineno + 1, byte_offset=offset,
            message=f"{src}:{lineno + 1} (compressed byte ~{offset}): {msg}; "
                    f"{lineno} line(s) before it were read, the rest of the file is lost",
            raw=raw or None, raw_chars=n if raw else None, raw_truncated=trunc))

    def _quarantine_oversized(self, q, src: str, lineno: int, size: int, head: bytes) -> None:
        self._quarantine(q, QuarantineItem(
            reason="record_too_large", source_file=src, line=lineno,
            message=f"{src}:{lineno}: a record of {size} bytes, over the limit of {self.max_record_bytes} bytes",
            raw=excerpt(head.decode("utf-8", "replace"), self.max_excerpt_chars)[0], raw_truncated=True))

    def _quarantine_unparsed(self, q, src: str, lineno: int, raw_line: bytes, e: BaseException) -> None:
        reason = _parse_failure(e)
        raw, n, trunc = excerpt(raw_line.decode("utf-8", "replace"), self.max_excerpt_chars)
        self._quarantine(q, QuarantineItem(
            reason=reason, source_file=src, line=lineno, raw=raw, raw_chars=n, raw_truncated=trunc,
            message=f"{src}:{lineno}: {reason.replace('_', ' ')}: {type(e).__name__}: {str(e)[:500]}"))

    def _unreadable(self, q, src: str, message: str, **where) -> None:
        self.summary.read += 1
        self._counts(src).read += 1
        self._quarantine(q, QuarantineItem(reason="unreadable_file", message=message, source_file=src, **where))

    def _read_parquet(self, q, path: Path) -> Iterator[TrajectoryRecord]:
        src = str(path)
        fc = self._counts(src)
        try:
            pf = pq.ParquetFile(path, page_checksum_verification=True)
            meta = pf.metadata
        except Exception as e:  # ArrowInvalid (bad magic / footer), OSError, ...
            self._unreadable(q, src, f"{src}: unreadable Parquet file: {type(e).__name__}: {e}")
            return
        row0 = 0
        for rg in range(meta.num_row_groups):
            nrows = meta.row_group(rg).num_rows
            try:
                table = pf.read_row_group(rg)
                rows = table_rows(table)
            except Exception as e:
                self.summary.read += 1
                fc.read += 1
                self._quarantine(
                    q,
                    QuarantineItem(
                        reason="unreadable_row_group",
                        message=f"{src}#row_group={rg} (rows {row0}..{row0 + nrows - 1}): "
                        f"cannot decode: {type(e).__name__}: {e}",
                        source_file=src,
                        row=row0,
                        row_group=rg,
                        lost_rows=nrows,
                    ),
                )
                row0 += nrows
                continue
            for i, obj in enumerate(rows):
                self.summary.read += 1
                fc.read += 1
                rec = self._handle(
                    q, src, obj, lambda o=obj: json.dumps(jsonable(o), ensure_ascii=False), row=row0 + i
                )
                if rec is not None:
                    yield rec
            row0 += nrows

    # -- iteration ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[TrajectoryRecord]:
        if self._used:
            raise RuntimeError("TrajectoryReader is single-use; create a new one to read again")
        self._used = True
        q = QuarantineWriter(self._quarantine_path)
        try:
            for path in self.files:
                if file_format(path) == "parquet":
                    yield from self._read_parquet(q, path)
                else:
                    yield from self._read_jsonl(q, path)
            self.summary.complete = True
        finally:
            q.close()
            self.summary.quarantine_lines_written = q.lines


def load_trajectories(
    paths: Iterable[str | os.PathLike] | str | os.PathLike,
    vocab_size: int,
    *,
    quarantine_path: str | os.PathLike | None = None,
    **kwargs: Any,
) -> tuple[list[TrajectoryRecord], IngestSummary]:
    """Read everything into a list; returns (records, summary) with the summary already checked."""
    reader = TrajectoryReader(paths, vocab_size, quarantine_path=quarantine_path, **kwargs)
    records = list(reader)
    return records, reader.summary.check()
