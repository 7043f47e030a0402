"""Trajectory files: which files a list of paths names, their format, and their contents as lines (plain or gzip
JSONL; a line over the size limit is never held whole; a broken gzip stream gives its lines up to the break)
or as Parquet rows."""

from __future__ import annotations

import datetime as _dt
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
GZIP_MAGIC = b"\x1f\x8b"


def file_format(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(".jsonl.gz"):
        return "jsonl.gz"
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return None


def expand_paths(paths: Iterable[str | os.PathLike] | str | os.PathLike) -> list[Path]:
    """Files and folders -> the sorted, de-duplicated list of trajectory files.

    Folders are searched recursively for ``*.jsonl``, ``*.jsonl.gz`` and ``*.parquet``; names starting
    with ``.`` (e.g. the writer's temp files) are skipped. An explicitly named file must have one of
    those suffixes. Missing paths raise ``FileNotFoundError`` (a configuration error, not a data error).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    seen: set[str] = set()
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and file_format(f) and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
        elif p.exists():
            if file_format(p) is None:
                raise ValueError(f"{p}: not a trajectory file (expected {JSONL_SUFFIXES + PARQUET_SUFFIXES})")
            found = [p]
        else:
            raise FileNotFoundError(f"trajectory path {p} does not exist")
        for f in found:
            key = os.path.realpath(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def excerpt(text: str, limit: int) -> tuple[str, int, bool]:
    return (text if len(text) <= limit else text[:limit]), len(text), len(text) > limit


def jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


class LineSplitter:
    """Bytes in, ("line", bytes) out. A line longer than ``limit`` bytes is never held whole: it comes out
    as ("oversized", size, first bytes) once its end is seen."""

    HEAD = 4096

    def __init__(self, limit: int):
        self.limit = limit
        self.pending = b""
        self.skipped = 0  # bytes of an oversized line dropped so far
        self.head = b""

    def _one(self, line: bytes):
        return ("oversized", len(line), line[: self.HEAD]) if len(line) > self.limit else ("line", line)

    def feed(self, data: bytes):
        parts = (self.pending + data).split(b"\n")
        self.pending = parts.pop()
        for line in parts:
            if self.skipped:
                yield ("oversized", self.skipped + len(line), self.head)
                self.skipped = 0
            else:
                yield self._one(line)
        if self.skipped or len(self.pending) > self.limit:
            if not self.skipped:
                self.head = self.pending[: self.HEAD]
            self.skipped += len(self.pending)
            self.pending = b""

    def finish(self):
        if self.skipped:
            yield ("oversized", self.skipped + len(self.pending), self.head)
        elif self.pending:
            yield self._one(self.pending)

    def tail(self) -> bytes:
        return self.head if self.skipped else self.pending


def plain_lines(path: Path, limit: int, chunk_size: int = 1 << 20):
    lines = LineSplitter(limit)
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            yield from lines.feed(block)
    yield from lines.finish()


def gzip_lines(path: Path, limit: int, chunk_size: int = 1 << 20):
    """Yield ("line", bytes) / ("oversized", size, head) for every line, then possibly one
    ("corrupt", offset, message, tail).

    Decompresses with zlib directly (multi-member aware, CRC checked) so that every complete line
    decompressed before a truncation or corruption is delivered.
    """
    lines = LineSplitter(limit)
    offset = 0  # compressed bytes consumed so far
    with open(path, "rb") as f:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        in_member = False
        try:
            while True:
                raw = f.read(chunk_size)
                if not raw:
                    break
                data = raw
                while data:
                    if d.eof:  # previous member ended: the rest must be another member (or zero padding)
                        if not data.strip(b"\x00"):
                            data = b""
                            break
                        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    in_member = True
                    out = d.decompress(data, 1 << 24)
                    data = d.unconsumed_tail
                    if d.eof:
                        data = d.unused_data + data
                        in_member = False
                    if out:
                        yield from lines.feed(out)
                offset += len(raw)
        except zlib.error as e:
            yield ("corrupt", offset, f"corrupt gzip data: {e}", lines.tail())
            return
        if in_member and not d.eof:
            yield ("corrupt", offset, "gzip stream truncated (compressed file ended before end-of-stream)", lines.tail())
            return
    yield from lines.finish()


def table_rows(table) -> list[dict[str, Any]]:
    """Arrow table -> row dicts; integer list columns become numpy slices (no per-token Python ints)."""
    n = table.num_rows
    columns: dict[str, list] = {}
    for name in table.column_names:
        col = table.column(name)
        typ = col.type
        if (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_integer(typ.value_type):
            arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
            if arr.values.null_count == 0:
                offsets = arr.offsets.to_numpy()
                values = arr.values.to_numpy(zero_copy_only=False)
                valid = arr.is_valid().to_numpy(zero_copy_only=False)
                columns[name] = [values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(n)]
                continue
        columns[name] = col.to_pylist()
    return [{name: columns[name][i] for name in columns} for i in range(n)]
