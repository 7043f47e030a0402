"""What a cache was built from: content hashes of a dataset's token ids and of a prefix tree."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def ids_chunk(dataset, r0: int, r1: int, column: str = "input_ids") -> tuple[np.ndarray, np.ndarray]:
    """(lengths int64 [r1-r0], flat values int64) of rows r0..r1-1, through Arrow (respects select/shuffle)."""
    table = dataset.with_format("arrow")[r0:r1]
    arr = table.column(column).combine_chunks()
    if isinstance(arr, pa.ChunkedArray):  # zero chunks
        arr = pa.array([], type=arr.type)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    return lengths, values


def iter_rows(dataset, batch_rows: int = 4096):
    """Yield (row index, int64 token ids) in row order, read in Arrow batches."""
    n = len(dataset)
    for r0 in range(0, n, batch_rows):
        lengths, values = ids_chunk(dataset, r0, min(n, r0 + batch_rows))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for j in range(len(lengths)):
            yield r0 + j, values[offsets[j]:offsets[j + 1]]


def scan_dataset(dataset, batch_rows: int = 4096) -> tuple[np.ndarray, str]:
    """One pass over ``input_ids``: per-row lengths and the content fingerprint."""
    h = hashlib.blake2b(digest_size=16)
    n = len(dataset)
    h.update(np.int64(n).tobytes())
    all_lengths = []
    for r0 in range(0, n, batch_rows):
        lengths, values = ids_chunk(dataset, r0, min(n, r0 + batch_rows))
        h.update(lengths.tobytes())
        h.update(values.tobytes())
        all_lengths.append(lengths)
    lengths = np.concatenate(all_lengths) if all_lengths else np.zeros(0, np.int64)
    return lengths, "blake2b-ids:" + h.hexdigest()


def dataset_fingerprint(dataset) -> str:
    """Content hash of a dataset's ``input_ids`` (row count, every length, every id, in row order).

    Features depend on nothing else, so two datasets with equal fingerprints can share a cache; the
    HF ``_fingerprint`` is not used because it changes with unrelated transforms and is random for
    some constructions.
    """
    return scan_dataset(dataset)[1]


def tree_fingerprint(edges: Iterable[Any]) -> str:
    """Hash of a prefix tree's edges (id, parent, start, tokens) in DFS order."""
    h = hashlib.blake2b(digest_size=16)
    for e in edges:
        h.update(np.array([e.edge_id, e.parent_id, e.start, len(e.tokens)], np.int64).tobytes())
        h.update(np.asarray(e.tokens, np.int32).tobytes())
    return "blake2b-tree:" + h.hexdigest()
