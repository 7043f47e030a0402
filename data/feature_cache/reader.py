"""The one reader of a feature cache: lazy, memory-mapped, dequantising, and checked against its dataset."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from data.feature_cache.fingerprints import dataset_fingerprint
from data.feature_cache.quantization import dequantize_fp8, feature_bytes_per_token
from data.feature_cache.store import (
    CACHE_FORMAT,
    CACHE_VERSION,
    INDEX_FILE,
    CacheMismatchError,
)


class FeatureCacheReader:
    """Lazy reader of a feature cache; ``get(i)`` -> (selected ``[T, K*H]``, final_hidden ``[T, H]``).

    Segments are rows (``kind == "rows"``) or prefix-tree edges (``kind == "tree"``; assemble paths with
    :meth:`get_path` / :meth:`get_window`). A dataset's cache, of either kind, serves its rows with
    :meth:`get_row`. Shards are opened with safetensors ``safe_open`` (memory
    mapped) and only the requested token range is read; up to ``max_open_shards`` handles are kept
    (LRU). Picklable (handles are reopened in the new process), so it can live in DataLoader workers.
    ``dataset``: if given, :meth:`check_dataset` runs first and a mismatch raises
    :class:`CacheMismatchError`.
    """

    def __init__(self, out_dir: str | os.PathLike, dataset=None, *, dtype: torch.dtype = torch.bfloat16,
                 max_open_shards: int = 64):
        self.out_dir = Path(out_dir)
        index_path = self.out_dir / INDEX_FILE
        if not index_path.exists():
            raise FileNotFoundError(f"no feature cache in {self.out_dir} ({INDEX_FILE} missing)")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != CACHE_FORMAT or self.index.get("version") != CACHE_VERSION:
            raise CacheMismatchError(f"{index_path}: not a {CACHE_FORMAT} v{CACHE_VERSION} index "
                                     f"(found v{self.index.get('version')}); capture the cache again")
        if not self.index.get("complete"):
            raise CacheMismatchError(f"{self.out_dir}: the capture is incomplete; run the capture again to resume it")
        self.kind: str = self.index["kind"]
        self.dtype = dtype
        self.max_open_shards = max_open_shards
        self.layer_ids: list[int] = self.index["layer_ids"]
        self.hidden_size: int = self.index["hidden_size"]
        self.cache_dtype: str = self.index["dtype"]
        shard_of, offset_of, length_of = [], [], []
        for s_no, shard in enumerate(self.index["shards"]):
            lens = np.asarray(shard["lengths"], np.int64)
            shard_of.append(np.full(len(lens), s_no, np.int64))
            offset_of.append(np.concatenate([[0], np.cumsum(lens)[:-1]]) if len(lens) else lens)
            length_of.append(lens)
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
        self._shard, self._offset, self._length = cat(shard_of), cat(offset_of), cat(length_of)
        self._handles: OrderedDict[int, Any] = OrderedDict()
        rows = self.index.get("rows")
        self._row_edge = np.asarray(rows["edge"], np.int64) if rows else None
        self._row_length = np.asarray(rows["length"], np.int64) if rows else None
        if self.kind == "tree":
            t = self.index["tree"]
            self._parent = np.asarray(t["parent"], np.int64)
            self._start = np.asarray(t["start"], np.int64)
            self._leaves = np.asarray(t["leaves"], np.int64)
        if dataset is not None:
            self.check_dataset(dataset)

    # -- bookkeeping ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Segments in the cache: dataset rows, or tree edges."""
        return int(self._length.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self._length.sum())

    @property
    def bytes_per_token(self) -> float:
        """Shard bytes on disk per cached token (features + scales + ids + headers)."""
        n = self.num_tokens
        return sum(s["bytes"] for s in self.index["shards"]) / n if n else 0.0

    @property
    def feature_bytes_per_token(self) -> int:
        return feature_bytes_per_token(len(self.layer_ids), self.hidden_size, self.cache_dtype)

    def locate(self, i: int) -> tuple[str, int, int]:
        """(shard file, token offset in the shard, length) of segment i."""
        i = self._check(i)
        return self.index["shards"][self._shard[i]]["file"], int(self._offset[i]), int(self._length[i])

    def _check(self, i: int) -> int:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"segment {i} out of range for a cache of {n}")
        return i

    def _handle(self, s_no: int):
        h = self._handles.get(s_no)
        if h is None:
            h = safe_open(str(self.out_dir / self.index["shards"][s_no]["file"]), framework="pt", device="cpu")
            self._handles[s_no] = h
            while len(self._handles) > self.max_open_shards:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(s_no)
        return h

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = OrderedDict()
        return state

    # -- reads ---------------------------------------------------------------------------------------

    def _read(self, i: int, lo: int, hi: int, dtype: torch.dtype | None, ids: bool = False):
        s_no = int(self._shard[i])
        base = int(self._offset[i])
        h = self._handle(s_no)
        a, b = base + lo, base + hi
        if ids:
            return h.get_slice("input_ids")[a:b]
        dtype = dtype or self.dtype
        sel = h.get_slice("selected")[a:b]
        fin = h.get_slice("final_hidden")[a:b]
        if self.cache_dtype == "fp8":
            sel = dequantize_fp8(sel, h.get_slice("selected_scale")[a:b], dtype)
            fin = dequantize_fp8(fin, h.get_slice("final_scale")[a:b], dtype)
        else:
            sel, fin = sel.to(dtype), fin.to(dtype)
        return sel, fin

    def get(self, i: int, dtype: torch.dtype | None = None, start: int = 0, end: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(selected [T, K*H], final_hidden [T, H]) of segment i, tokens [start, end), as ``dtype``."""
        i = self._check(i)
        n = int(self._length[i])
        end = n if end is None else end
        if not 0 <= start <= end <= n:
            raise IndexError(f"token range [{start}, {end}) out of segment {i} of length {n}")
        return self._read(i, start, end, dtype)

    def get_ids(self, i: int) -> torch.Tensor:
        """The int32 token ids segment i was captured from."""
        i = self._check(i)
        return self._read(i, 0, int(self._length[i]), None, ids=True)

    __getitem__ = get

    def first_ids(self) -> np.ndarray:
        """Each segment's first token id (-1 for an empty segment), from one read of each shard's ids."""
        out = np.full(len(self), -1, np.int64)
        bounds = np.searchsorted(self._shard, np.arange(len(self.index["shards"]) + 1))  # segments lie in shard order
        for s_no in range(len(bounds) - 1):
            segs = np.arange(bounds[s_no], bounds[s_no + 1])
            segs = segs[self._length[segs] > 0]
            if len(segs):
                ids = self._handle(s_no).get_slice("input_ids")[:].numpy()
                out[segs] = ids[self._offset[segs]]
        return out

    # -- tree caches ---------------------------------------------------------------------------------

    def _need_tree(self) -> None:
        if self.kind != "tree":
            raise TypeError(f"{self.out_dir} is a {self.kind!r} cache; paths need a prefix-tree cache")

    def leaf_edge(self, leaf_id: int) -> int:
        """Edge id of leaf ``leaf_id`` (DFS order, = TrainingPath.leaf_id)."""
        self._need_tree()
        return int(self._leaves[leaf_id])

    @property
    def parents(self) -> np.ndarray:
        """Each edge's parent edge id (-1 for a root's child)."""
        self._need_tree()
        return self._parent

    @property
    def num_leaves(self) -> int:
        self._need_tree()
        return int(self._leaves.shape[0])

    def path_edges(self, edge_id: int) -> list[int]:
        """Edge ids from the root to ``edge_id`` (inclusive)."""
        self._need_tree()
        chain, e = [], self._check(edge_id)
        while e != -1:
            chain.append(e)
            e = int(self._parent[e])
        return chain[::-1]

    def _pieces(self, edge_id: int, start: int, end: int | None):
        chain = self.path_edges(edge_id)
        total = int(self._start[chain[-1]] + self._length[chain[-1]])
        end = total if end is None else end
        if not 0 <= start <= end <= total:
            raise IndexError(f"window [{start}, {end}) outside a path of {total} tokens")
        for e in chain:
            lo, hi = max(start, int(self._start[e])), min(end, int(self._start[e] + self._length[e]))
            if lo < hi:
                yield e, lo - int(self._start[e]), hi - int(self._start[e])

    def get_path(self, edge_id: int, start: int = 0, end: int | None = None, dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Features of the root-to-``edge_id`` path, absolute positions [start, end), edges concatenated."""
        sel, fin = [], []
        for e, lo, hi in self._pieces(edge_id, start, end):
            s, f = self._read(e, lo, hi, dtype)
            sel.append(s)
            fin.append(f)
        return (torch.cat(sel), torch.cat(fin)) if sel else self._empty(dtype)

    def _empty(self, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        d = dtype or self.dtype
        return torch.zeros(0, len(self.layer_ids) * self.hidden_size, dtype=d), torch.zeros(0, self.hidden_size, dtype=d)

    def get_path_ids(self, edge_id: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        parts = [self._read(e, lo, hi, None, ids=True) for e, lo, hi in self._pieces(edge_id, start, end)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)

    def get_window(self, leaf_id: int, window_start: int, length: int, dtype: torch.dtype | None = None):
        """Features for a :class:`~data.trajectory.prefix_tree.TrainingPath` (``leaf_id``, ``window_start``, len)."""
        return self.get_path(self.leaf_edge(leaf_id), window_start, window_start + length, dtype)

    # -- dataset rows --------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        """Rows of the dataset this cache was built for (0: a tree of logged requests, read by path)."""
        meta = self.index.get("dataset")
        return int(meta["num_rows"]) if meta else 0

    def get_row(self, r: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(selected, final_hidden) of dataset row r (its first ``max_seq_len`` tokens), from either kind:
        a row segment, or the row's path through the prefix tree of rows."""
        if not self.num_rows:
            raise TypeError(f"{self.out_dir} holds a tree of logged requests, not a dataset's rows; use get_path")
        if not 0 <= r < self.num_rows:
            raise IndexError(f"row {r} out of range for a cache of {self.num_rows} rows")
        if self.kind == "rows":
            return self.get(r, dtype)
        edge = int(self._row_edge[r])
        return self.get_path(edge, 0, int(self._row_length[r]), dtype) if edge >= 0 else self._empty(dtype)

    def row_ids(self, r: int) -> torch.Tensor:
        """The int32 token ids of dataset row r's cached tokens (its first ``max_seq_len``)."""
        if self.kind == "rows":
            return self.get_ids(r)
        edge = int(self._row_edge[r])
        return self.get_path_ids(edge, 0, int(self._row_length[r])) if edge >= 0 else torch.zeros(0, dtype=torch.int32)

    def row_length(self, r: int) -> int:
        """Tokens cached for dataset row r (its length, at most the capture's ``max_seq_len``)."""
        if self.kind == "rows":
            return int(self._length[self._check(r)])
        return int(self._row_length[r])

    # -- dataset check -------------------------------------------------------------------------------

    def check_dataset(self, dataset) -> None:
        """Raise :class:`CacheMismatchError` unless this cache was built for ``dataset``.

        Caches of a dataset (rows, or the tree of its rows): same row count, then the same ``input_ids``
        fingerprint. Trees of logged requests: every row (with ``provenance.leaf_id`` / ``window_start``,
        as made by ``PrefixTree.to_dataset``) must equal the cached tokens of its window.
        """
        if self.index.get("dataset"):
            meta = self.index["dataset"]
            if len(dataset) != meta["num_rows"]:
                raise CacheMismatchError(
                    f"feature cache {self.out_dir} was built for {meta['num_rows']} rows, the dataset has "
                    f"{len(dataset)}; rebuild the cache for this dataset (features.mode=offline)")
            fp = dataset_fingerprint(dataset)
            if fp != meta["fingerprint"]:
                raise CacheMismatchError(
                    f"feature cache {self.out_dir} was built for a different dataset with the same row count "
                    f"(input_ids fingerprint {meta['fingerprint']} vs {fp}); rebuild the cache for this dataset")
            return
        if "provenance" not in dataset.column_names:
            raise CacheMismatchError("a prefix-tree cache needs a dataset with provenance (PrefixTree.to_dataset)")
        prov = dataset["provenance"]
        for r in range(len(dataset)):
            leaf, ws = int(prov[r]["leaf_id"]), int(prov[r]["window_start"])
            ids = np.asarray(dataset[r]["input_ids"], np.int32)
            if not 0 <= leaf < self.num_leaves:
                raise CacheMismatchError(f"dataset row {r}: leaf {leaf} not in the cached tree ({self.num_leaves} leaves)")
            try:
                cached = self.get_path_ids(self.leaf_edge(leaf), ws, ws + len(ids)).numpy()
            except IndexError:
                cached = None
            if cached is None or not np.array_equal(cached, ids):
                raise CacheMismatchError(f"dataset row {r} (leaf {leaf}, window {ws}) does not match the cached tree's tokens; "
                                         "rebuild the cache for this dataset")
