"""Writing trajectory files atomically (temp file in the target folder, fsync, ``os.replace``): JSONL, JSONL.gz or
Parquet, for the traffic simulator, the log tap and the tests. The writer never produces a record the reader
would quarantine."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.atomic_files import atomic_path
from data.trajectory.files import file_format
from data.trajectory.records import InvalidRecord, TrajectoryRecord, validate_record


def _coerce(rec: TrajectoryRecord | Mapping) -> TrajectoryRecord:
    if isinstance(rec, TrajectoryRecord):
        return rec
    try:
        return validate_record(rec, None)
    except InvalidRecord as e:
        raise ValueError(f"refusing to write an invalid record ({e.reason}): {e.message}") from None


def _format_of(path: Path, fmt: str | None) -> str:
    fmt = fmt or file_format(path)
    if fmt not in ("jsonl", "jsonl.gz", "parquet"):
        raise ValueError(f"{path}: cannot infer the format; use a .jsonl, .jsonl.gz or .parquet suffix or format=")
    return fmt


def write_trajectories(
    records: Iterable[TrajectoryRecord | Mapping],
    path: str | os.PathLike,
    *,
    format: str | None = None,
    row_group_size: int = 256,
    compresslevel: int = 6,
) -> int:
    """Write records atomically (temp file in the same folder + fsync + ``os.replace``).

    ``format`` defaults from the suffix (``.jsonl``, ``.jsonl.gz``, ``.parquet``). Mappings are validated
    first (no vocabulary check) and invalid ones raise ``ValueError``: the writer never produces a file
    the reader would quarantine (except duplicates across files). Parquet: zstd, page checksums on,
    ``row_group_size`` records per row group, ids as ``list<int32>``, metadata as a JSON string.
    Returns the number of records written.
    """
    path = Path(path)
    fmt = _format_of(path, format)
    n = 0
    with atomic_path(path) as tmp:
        if fmt == "parquet":
            n = _write_parquet(records, str(tmp), row_group_size)
        else:
            opener = (
                (lambda: gzip.open(tmp, "wt", encoding="utf-8", compresslevel=compresslevel))
                if fmt == "jsonl.gz"
                else (lambda: open(tmp, "w", encoding="utf-8"))
            )
            with opener() as f:
                for rec in records:
                    f.write(json.dumps(_coerce(rec).to_json_dict(), separators=(",", ":"), ensure_ascii=False))
                    f.write("\n")
                    n += 1
    return n


def _parquet_schema():
    return pa.schema(
        [
            ("session_id", pa.string()),
            ("request_id", pa.string()),
            ("parent_request_id", pa.string()),
            ("timestamp", pa.float64()),
            ("input_ids", pa.list_(pa.int32())),
            ("output_ids", pa.list_(pa.int32())),
            ("metadata", pa.string()),
        ]
    )


def _ids_array(arrays: list[np.ndarray]):
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(np.int32) if arrays else np.empty(0, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int32()))


def _write_parquet(records: Iterable[TrajectoryRecord | Mapping], tmp: str, row_group_size: int) -> int:
    schema = _parquet_schema()
    n = 0
    batch: list[TrajectoryRecord] = []

    def flush(writer):
        cols = [
            pa.array([r.session_id for r in batch], pa.string()),
            pa.array([r.request_id for r in batch], pa.string()),
            pa.array([r.parent_request_id for r in batch], pa.string()),
            pa.array([r.timestamp for r in batch], pa.float64()),
            _ids_array([r.input_ids for r in batch]),
            _ids_array([r.output_ids for r in batch]),
            pa.array([json.dumps(r.metadata, ensure_ascii=False) for r in batch], pa.string()),
        ]
        writer.write_table(pa.Table.from_arrays(cols, schema=schema), row_group_size=row_group_size)
        batch.clear()

    with pq.ParquetWriter(tmp, schema, compression="zstd", write_page_checksum=True) as writer:
        for rec in records:
            batch.append(_coerce(rec))
            n += 1
            if len(batch) >= row_group_size:
                flush(writer)
        if batch:
            flush(writer)
    return n
