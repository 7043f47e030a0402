"""Offline target-feature cache: capture the target once, train many epochs from disk.

A DFlash drafter consumes, at every position, the K selected target layer outputs (``selected``,
``[T, K*H]``) and, for KL targets, the target's final normed hidden state (``final_hidden``, ``[T, H]``).
Running the target every epoch costs as much as the drafter step itself, so ``features.mode: offline``
captures them once into this cache.

Two producers, one on-disk format, one reader:

* :func:`write_feature_cache` - one *segment* per dataset row (``kind = "rows"``). Rows are captured in
  batches (right padding + attention mask; padding is dropped before storing), batches are formed
  inside a shard from length-sorted rows so little compute is wasted on padding.
* :func:`write_tree_feature_cache` - one segment per edge of a :class:`data.prefix_tree.PrefixTree`
  (``kind = "tree"``). Every unique token is run through the target ONCE: edges are visited in DFS
  preorder and each continues from the KV cache of its parent path (absolute position ids
  ``start + arange``). A root-to-leaf path, or any window of it, is the concatenation of its edges'
  features (:meth:`FeatureCacheReader.get_path`, :meth:`FeatureCacheReader.get_window`).
* :class:`FeatureCacheReader` - lazy, memory-mapped (safetensors ``safe_open``, open handles cached),
  dequantises to the requested dtype, and refuses a dataset the cache was not built from.

The on-disk format, crash safety and resume are described in data/FEATURE_CACHE_FORMAT.md.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.atomic_files import atomic_path, write_json_atomic
from common.locks import FileLock

__all__ = [
    "CACHE_FORMAT",
    "CACHE_VERSION",
    "FP8_MAX",
    "CacheMismatchError",
    "CacheWriteResult",
    "FeatureCacheReader",
    "TreeCaptureStats",
    "iter_tree_features",
    "dataset_fingerprint",
    "dequantize_fp8",
    "feature_bytes_per_token",
    "feature_cache_kwargs",
    "quantize_fp8",
    "tree_fingerprint",
    "write_feature_cache",
    "write_tree_feature_cache",
]

CACHE_FORMAT = "dflash-feature-cache"
CACHE_VERSION = 1
INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
CACHE_DTYPES = ("bf16", "fp8")  # how features are stored
# Index keys whose values must agree for a resume (everything that changes what the shards hold).
_COMPAT_KEYS = ("format", "version", "kind", "dtype", "layer_ids", "hidden_size", "num_layers_selected",
                "shard_tokens", "target", "dataset", "tree")


class CacheMismatchError(ValueError):
    """The cache was built for different data, target or settings than it is used with."""


# ---------------------------------------------------------------------------------------------------
# Quantisation
# ---------------------------------------------------------------------------------------------------

def quantize_fp8(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, D]`` -> (``q [N, D]`` float8_e4m3fn, ``scale [N, groups]`` float32).

    The last dim is split into ``groups`` equal tensors; each (token, group) gets scale = amax / 448.
    """
    n, d = x.shape
    if d % groups:
        raise ValueError(f"dim {d} is not divisible into {groups} groups")
    xf = x.float().reshape(n, groups, d // groups)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if not torch.isfinite(amax).all():
        raise ValueError("non-finite target features (NaN/inf) cannot be stored; check the target's dtype")
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, d), scale.reshape(n, groups)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, d = q.shape
    g = scale.shape[-1]
    out = q.float().reshape(n, g, d // g) * scale.float().reshape(n, g, 1)
    return out.reshape(n, d).to(dtype)


def feature_bytes_per_token(num_layers_selected: int, hidden_size: int, dtype: str) -> int:
    """Bytes one token costs in a shard: features (+ fp8 scales) + the int32 token id."""
    k, h = num_layers_selected, hidden_size
    if dtype == "bf16":
        return (k + 1) * h * 2 + 4
    if dtype == "fp8":
        return (k + 1) * h + (k + 1) * 4 + 4
    raise ValueError(f"unknown cache dtype {dtype!r} (expected one of {CACHE_DTYPES})")


# ---------------------------------------------------------------------------------------------------
# Fingerprints
# ---------------------------------------------------------------------------------------------------

def _ids_chunk(dataset, r0: int, r1: int, column: str = "input_ids") -> tuple[np.ndarray, np.ndarray]:
    """(lengths int64 [r1-r0], flat values int64) of rows r0..r1-1, through Arrow (respects select/shuffle)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[r0:r1]
    arr = table.column(column).combine_chunks()
    if isinstance(arr, pa.ChunkedArray):  # zero chunks
        arr = pa.array([], type=arr.type)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    return lengths, values


def _scan_dataset(dataset, batch_rows: int = 4096) -> tuple[np.ndarray, str]:
    """One pass over ``input_ids``: per-row lengths and the content fingerprint."""
    h = hashlib.blake2b(digest_size=16)
    n = len(dataset)
    h.update(np.int64(n).tobytes())
    all_lengths = []
    for r0 in range(0, n, batch_rows):
        lengths, values = _ids_chunk(dataset, r0, min(n, r0 + batch_rows))
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
    return _scan_dataset(dataset)[1]


def tree_fingerprint(edges: Iterable[Any]) -> str:
    """Hash of a prefix tree's edges (id, parent, start, tokens) in DFS order."""
    h = hashlib.blake2b(digest_size=16)
    for e in edges:
        h.update(np.array([e.edge_id, e.parent_id, e.start, len(e.tokens)], np.int64).tobytes())
        h.update(np.asarray(e.tokens, np.int32).tobytes())
    return "blake2b-tree:" + h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# Atomic files
# ---------------------------------------------------------------------------------------------------

def _save_safetensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path.stat().st_size


def _dir_lock(out_dir: Path) -> FileLock:
    return FileLock(out_dir / LOCK_FILE, f"another process is writing the feature cache in {out_dir}")


# ---------------------------------------------------------------------------------------------------
# Shard writer (shared by the row and tree producers)
# ---------------------------------------------------------------------------------------------------

@dataclass
class CacheWriteResult:
    out_dir: str
    kind: str
    complete: bool
    shards_total: int  # completed shards now on disk
    shards_written: int  # by this call
    segments: int  # rows or edges in the cache (complete or not)
    tokens_captured: int  # features computed and stored by this call
    tokens_context: int  # tree resume only: ancestor tokens re-run to rebuild a KV cache (not stored)
    padded_tokens: int  # rows only: padding positions the target computed in batches
    seconds: float
    tokens_per_s: float
    bytes_per_token: float  # shard bytes on disk / cached tokens (all shards so far)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _target_identity(capture) -> dict[str, Any]:
    model = getattr(capture, "model", None)
    cfg = getattr(model, "config", None)
    ident: dict[str, Any] = {"capture": type(capture).__name__}
    if cfg is not None:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        ident.update(
            name_or_path=str(getattr(cfg, "_name_or_path", "")),
            model_type=getattr(cfg, "model_type", None),
            num_hidden_layers=getattr(text, "num_hidden_layers", None),
            hidden_size=getattr(text, "hidden_size", None),
            vocab_size=getattr(text, "vocab_size", None),
        )
    if model is not None:
        try:
            ident["param_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
        except StopIteration:
            pass
    return ident


def _hidden_size(capture) -> int:
    cfg = capture.model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(text.hidden_size)


class _ShardSink:
    """Accumulates segments in storage form and writes shards + index atomically."""

    def __init__(self, out_dir: Path, index: dict, dtype: str, k: int, progress: bool, total_segments: int):
        self.out_dir, self.index, self.dtype, self.k = out_dir, index, dtype, k
        self.progress, self.total_segments = progress, total_segments
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.lengths: list[int] = []
        self.first = self.next_segment
        self.written = 0
        self.t0 = time.perf_counter()
        self.tokens = 0

    @property
    def next_segment(self) -> int:
        shards = self.index["shards"]
        return shards[-1]["first"] + len(shards[-1]["lengths"]) if shards else 0

    @property
    def pending_tokens(self) -> int:
        return sum(self.lengths)

    def encode(self, selected: torch.Tensor, final_hidden: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Storage form on the CPU (quantised on the capture device, so only stored bytes cross to the host)."""
        tensors = {"input_ids": ids.to(torch.int32).cpu()}
        if self.dtype == "fp8":
            q, s = quantize_fp8(selected, self.k)
            qf, sf = quantize_fp8(final_hidden, 1)
            tensors.update(selected=q.cpu(), selected_scale=s.cpu(), final_hidden=qf.cpu(), final_scale=sf.cpu())
        else:
            tensors.update(selected=selected.to(torch.bfloat16).cpu(), final_hidden=final_hidden.to(torch.bfloat16).cpu())
        return tensors

    def add_encoded(self, tensors: dict[str, torch.Tensor]) -> None:
        n = int(tensors["input_ids"].shape[0])
        for name, t in tensors.items():
            self.parts.setdefault(name, []).append(t)
        self.lengths.append(n)
        self.tokens += n

    def add(self, selected: torch.Tensor, final_hidden: torch.Tensor, ids: torch.Tensor) -> None:
        self.add_encoded(self.encode(selected, final_hidden, ids))

    def flush(self) -> None:
        if not self.lengths:
            return
        shard_no = len(self.index["shards"])
        name = f"shard-{shard_no:05d}.safetensors"
        tensors = {k: torch.cat(v).contiguous() for k, v in self.parts.items()}
        meta = {"format": CACHE_FORMAT, "kind": self.index["kind"], "first": str(self.first),
                "lengths": json.dumps(self.lengths)}
        nbytes = _save_safetensors_atomic(self.out_dir / name, tensors, meta)
        self.index["shards"].append({"file": name, "first": self.first, "lengths": list(self.lengths),
                                     "tokens": int(sum(self.lengths)), "bytes": int(nbytes)})
        write_json_atomic(self.out_dir / INDEX_FILE, self.index, compact=True)
        self.written += 1
        if self.progress:
            dt = time.perf_counter() - self.t0
            done = self.first + len(self.lengths)
            print(f"[feature-cache] {name}: {self.index['kind']} {done}/{self.total_segments}, "
                  f"{self.tokens / max(dt, 1e-9):.0f} tok/s", file=sys.stderr, flush=True)
        self.parts, self.lengths = {}, []
        self.first = self.next_segment

    def cached_bytes_per_token(self) -> float:
        shards = self.index["shards"]
        tokens = sum(s["tokens"] for s in shards)
        return sum(s["bytes"] for s in shards) / tokens if tokens else 0.0


def _open_or_create(out_dir: Path, header: dict, overwrite: bool) -> dict:
    """Existing compatible index (resume), or a fresh one; cleans files the index does not list."""
    index_path = out_dir / INDEX_FILE
    index = None
    if index_path.exists() and not overwrite:
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as err:  # cannot happen with atomic writes; refuse to guess
            raise CacheMismatchError(f"{index_path} is not valid JSON ({err}); delete it or pass overwrite=True") from None
        diffs = [k for k in _COMPAT_KEYS if index.get(k) != header.get(k)]
        if diffs:
            raise CacheMismatchError(
                f"{out_dir} holds a feature cache built with different {', '.join(diffs)} "
                f"(e.g. {diffs[0]}: cached {_short(index.get(diffs[0]))} vs requested {_short(header.get(diffs[0]))}); "
                "use another directory or overwrite=True"
            )
        for shard in index["shards"]:
            p = out_dir / shard["file"]
            if not p.exists() or p.stat().st_size != shard["bytes"]:
                raise CacheMismatchError(f"{p} is listed in the index but missing or truncated; the cache is corrupt")
        index["capture"] = header["capture"]  # batch settings may differ between attempts
    if index is None:
        index = dict(header, shards=[], complete=False)
    listed = {s["file"] for s in index["shards"]} | {INDEX_FILE, LOCK_FILE}
    for p in out_dir.iterdir():
        if p.is_file() and p.name not in listed and (p.name.startswith("shard-") or (p.name.startswith(".") and p.name.endswith(".tmp"))):
            p.unlink()  # temp files and shards renamed but never indexed (crash between the two writes)
    if not index_path.exists() or overwrite:
        write_json_atomic(index_path, index, compact=True)
    return index


def _short(value: Any, limit: int = 120) -> str:
    s = json.dumps(value, default=str)
    return s if len(s) <= limit else s[:limit] + "..."


def _header(kind: str, capture, dtype: str, shard_tokens: int) -> dict:
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"unknown cache dtype {dtype!r} (expected one of {CACHE_DTYPES})")
    if shard_tokens < 1:
        raise ValueError("shard_tokens must be >= 1")
    layer_ids = list(capture.layer_ids)
    h = _hidden_size(capture)
    return {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "kind": kind,
        "dtype": dtype,
        "fp8": {"format": "float8_e4m3fn", "max": FP8_MAX,
                "scale": "float32 amax/448 per token and per tensor (each selected layer, final_hidden)"}
        if dtype == "fp8" else None,
        "layer_ids": layer_ids,
        "hidden_size": h,
        "num_layers_selected": len(layer_ids),
        "shard_tokens": int(shard_tokens),
        "target": _target_identity(capture),
        "dataset": None,
        "tree": None,
    }


# ---------------------------------------------------------------------------------------------------
# Producer 1: dataset rows
# ---------------------------------------------------------------------------------------------------

def feature_cache_kwargs(features_config) -> dict[str, Any]:
    """``write_*_feature_cache`` keyword arguments from a ``configs.schema.FeaturesConfig``."""
    return {"dtype": features_config.cache_dtype, "shard_tokens": int(features_config.shard_tokens)}


def _plan_shards(lengths: np.ndarray, shard_tokens: int) -> list[tuple[int, int]]:
    """[(first, end)) row ranges; a shard closes once it holds >= shard_tokens tokens."""
    plan, first, acc = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        acc += n
        if acc >= shard_tokens:
            plan.append((first, i + 1))
            first, acc = i + 1, 0
    if first < len(lengths):
        plan.append((first, len(lengths)))
    return plan


def _batches(lengths: list[int], batch_size: int, max_batch_tokens: int) -> list[list[int]]:
    """Local indices sorted by length (longest first), packed so rows * max_len <= max_batch_tokens."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    out, cur = [], []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) >= batch_size or (len(cur) + 1) * width > max_batch_tokens):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def write_feature_cache(
    dataset,
    capture,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bf16",
    shard_tokens: int = 65_536,
    batch_size: int = 8,
    max_batch_tokens: int = 16_384,
    pad_token_id: int = 0,
    progress: bool = True,
    overwrite: bool = False,
    stop_after_shards: int | None = None,
) -> CacheWriteResult:
    """Capture ``capture``'s features for every row of ``dataset`` (column ``input_ids``) into ``out_dir``.

    Rows of one shard are run in length-sorted batches of up to ``batch_size`` rows and
    ``max_batch_tokens`` padded tokens (right padding + attention mask, padding dropped before storing).
    Resumes a partial cache in ``out_dir`` (see the module docstring); ``stop_after_shards`` stops after
    that many shards were written by this call, leaving the cache exactly as a crash would.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lengths, fingerprint = _scan_dataset(dataset)
    header = _header("rows", capture, dtype, shard_tokens)
    header["dataset"] = {"num_rows": int(len(lengths)), "total_tokens": int(lengths.sum()), "fingerprint": fingerprint}
    header["capture"] = {"batch_size": batch_size, "max_batch_tokens": max_batch_tokens, "padding": "right",
                         "hf_fingerprint": getattr(dataset, "_fingerprint", None)}
    t0 = time.perf_counter()
    padded = 0
    with _dir_lock(out):
        index = _open_or_create(out, header, overwrite)
        plan = _plan_shards(lengths, shard_tokens)
        sink = _ShardSink(out, index, dtype, len(capture.layer_ids), progress, len(lengths))
        start_row = sink.next_segment
        if not index["complete"]:
            done_shards = len(index["shards"])
            if done_shards > len(plan) or (done_shards and plan[done_shards - 1][1] != start_row):
                raise CacheMismatchError(f"{out}: completed shards do not match the shard plan; use overwrite=True")
            for first, end in plan[done_shards:]:
                if stop_after_shards is not None and sink.written >= stop_after_shards:
                    break
                padded += _capture_rows(dataset, capture, sink, first, end, batch_size, max_batch_tokens, pad_token_id)
                sink.flush()
            if len(index["shards"]) == len(plan):
                index["complete"] = True
                write_json_atomic(out / INDEX_FILE, index, compact=True)
    dt = time.perf_counter() - t0
    return CacheWriteResult(
        out_dir=str(out), kind="rows", complete=bool(index["complete"]), shards_total=len(index["shards"]),
        shards_written=sink.written, segments=int(len(lengths)), tokens_captured=sink.tokens, tokens_context=0,
        padded_tokens=padded, seconds=dt, tokens_per_s=sink.tokens / dt if dt > 0 else 0.0,
        bytes_per_token=sink.cached_bytes_per_token(),
    )


def _capture_rows(dataset, capture, sink: _ShardSink, first: int, end: int, batch_size: int,
                  max_batch_tokens: int, pad_token_id: int) -> int:
    lengths, values = _ids_chunk(dataset, first, end)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = [torch.from_numpy(values[offsets[i]:offsets[i + 1]]) for i in range(len(lengths))]
    results: dict[int, dict[str, torch.Tensor]] = {}  # storage form: a shard never holds fp32 copies
    padded = 0
    for batch in _batches(lengths.tolist(), batch_size, max_batch_tokens):
        width = int(lengths[batch[0]])
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, i in enumerate(batch):
            ids[j, : lengths[i]] = rows[i]
            mask[j, : lengths[i]] = 1
        out = capture.capture(ids, attention_mask=None if bool(mask.all()) else mask)
        padded += int((mask == 0).sum())
        for j, i in enumerate(batch):
            n = int(lengths[i])
            results[i] = sink.encode(out.selected[j, :n], out.final_hidden[j, :n], rows[i])
        del out
    k_h = len(capture.layer_ids) * sink.index["hidden_size"]
    for i in range(len(lengths)):  # in row order; empty rows are stored with length 0
        if i not in results:
            results[i] = sink.encode(torch.zeros(0, k_h), torch.zeros(0, sink.index["hidden_size"]), rows[i])
        sink.add_encoded(results.pop(i))
    return padded


# ---------------------------------------------------------------------------------------------------
# Producer 2: prefix tree (each unique token once, KV reuse along the DFS path)
# ---------------------------------------------------------------------------------------------------

def _default_cache_factory(capture) -> Callable[[], Any]:
    from transformers import DynamicCache

    config = capture.model.config
    return lambda: DynamicCache(config=config)


def _crop(cache, length: int) -> None:
    from drafters.capture import crop_cache

    crop_cache(cache, length)


@dataclass
class TreeCaptureStats:
    tokens_computed: int = 0  # tokens whose features were produced (each unique token once)
    tokens_context: int = 0  # ancestor tokens re-run to rebuild a KV cache after skipping edges (resume)
    forward_calls: int = 0
    strategy: str = ""


def iter_tree_features(
    tree,
    capture,
    *,
    start_edge: int = 0,
    chunk_tokens: int = 8192,
    strategy: str = "auto",
    cache_factory: Callable[[], Any] | None = None,
    stats: TreeCaptureStats | None = None,
):
    """Yield ``(edge, selected [n, K*H], final_hidden [n, H])`` per edge of ``tree`` in DFS preorder.

    Each edge runs at absolute positions ``start + arange(n)`` (in chunks of ``chunk_tokens``) on top
    of a KV cache holding exactly its ancestors' tokens, so every unique token is computed once.
    Edges with id < ``start_edge`` are skipped (resume); the first computed edge's ancestors are then
    re-run once, without output, to rebuild its cache (``stats.tokens_context``).

    ``strategy``: ``"crop"`` keeps ONE cache and crops it back to the edge's start (a DFS step only
    returns to an ancestor, whose tokens are a prefix of the cache), so memory is one path's KV;
    ``"copy"`` keeps a deep-copied snapshot per non-leaf edge on the current DFS path (O(depth) caches;
    for caches that cannot be cropped, e.g. sliding-window layers); ``"auto"``: crop unless the cache
    has sliding-window layers or says it is not ``is_croppable``.
    """
    if strategy not in ("auto", "crop", "copy"):
        raise ValueError(f"unknown strategy {strategy!r}")
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    stats = stats if stats is not None else TreeCaptureStats()
    make_cache = cache_factory or _default_cache_factory(capture)

    def run(tokens: np.ndarray, start: int, cache, keep: bool):
        sel, fin = [], []
        for c0 in range(0, len(tokens), chunk_tokens):
            chunk = torch.from_numpy(np.asarray(tokens[c0:c0 + chunk_tokens], dtype=np.int64))[None]
            pos = torch.arange(start + c0, start + c0 + chunk.shape[1])[None]
            o = capture.capture(chunk, past_key_values=cache, position_ids=pos, with_final=True)
            stats.forward_calls += 1
            if keep:
                sel.append(o.selected[0])
                fin.append(o.final_hidden[0])
        return (torch.cat(sel), torch.cat(fin)) if keep else None

    anc: list = []  # DFS ancestor stack (TreeEdge): the current root-to-edge path
    snaps: list = []  # copy strategy: the cache after anc[i] (None for leaves and skipped edges)
    cache = None  # crop strategy: holds the tokens of anc[:cached]
    cached = 0
    use_crop: bool | None = None
    for e in tree.iter_edges():
        while anc and anc[-1].edge_id != e.parent_id:
            anc.pop()
            snaps.pop()
        if e.parent_id != -1 and not anc:
            raise ValueError(f"edge {e.edge_id}: parent {e.parent_id} is not on the DFS path")
        if e.edge_id < start_edge:
            anc.append(e)
            snaps.append(None)
            continue
        if use_crop is None:
            probe = make_cache()
            # A sliding-window layer only keeps the last W positions: it cannot be cropped back once full.
            croppable = bool(getattr(probe, "is_croppable", True)) and not any(getattr(probe, "is_sliding", []) or [])
            use_crop = strategy == "crop" or (strategy == "auto" and croppable)
            stats.strategy = "crop" if use_crop else "copy"
            del probe
        if use_crop:
            cached = min(cached, len(anc))
            if cache is None:
                cache, cached = make_cache(), 0
            _crop(cache, (anc[cached - 1].start + len(anc[cached - 1].tokens)) if cached else 0)
            if cached < len(anc):  # resume: rebuild the KV of ancestors that were skipped
                missing = anc[cached:]
                toks = np.concatenate([np.asarray(a.tokens) for a in missing])
                run(toks, missing[0].start, cache, keep=False)
                stats.tokens_context += len(toks)
            work = cache
        else:
            base = snaps[-1] if snaps else None
            if anc and base is None:  # resume: rebuild from scratch
                work = make_cache()
                toks = np.concatenate([np.asarray(a.tokens) for a in anc])
                run(toks, 0, work, keep=False)
                stats.tokens_context += len(toks)
            else:
                work = copy.deepcopy(base) if base is not None else make_cache()
        if work.get_seq_length() != e.start:
            raise RuntimeError(f"edge {e.edge_id}: KV cache holds {work.get_seq_length()} tokens, the edge starts at {e.start}")
        sel, fin = run(np.asarray(e.tokens), e.start, work, keep=True)
        stats.tokens_computed += len(e.tokens)
        anc.append(e)
        if use_crop:
            cached = len(anc)
            snaps.append(None)
        else:
            snaps.append(None if e.is_leaf else work)
        yield e, sel, fin


def write_tree_feature_cache(
    tree,
    capture,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bf16",
    shard_tokens: int = 65_536,
    chunk_tokens: int = 8192,
    strategy: str = "auto",
    cache_factory: Callable[[], Any] | None = None,
    progress: bool = True,
    overwrite: bool = False,
    stop_after_shards: int | None = None,
) -> CacheWriteResult:
    """Capture a :class:`~data.prefix_tree.PrefixTree`'s features once per unique token, one segment per edge.

    See :func:`iter_tree_features` for the KV reuse (``chunk_tokens``, ``strategy``,
    ``cache_factory``). Shards hold runs of edges in DFS order; resume and ``stop_after_shards`` work as
    for :func:`write_feature_cache` (a resumed run re-runs the first pending edge's ancestors once to
    rebuild its KV cache: ``tokens_context``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    edges_meta: dict[str, list[int]] = {"parent": [], "start": [], "length": []}
    leaves = []
    for e in tree.iter_edges():
        if e.edge_id != len(edges_meta["parent"]):
            raise ValueError("tree.iter_edges() must yield consecutive edge ids in DFS order")
        edges_meta["parent"].append(int(e.parent_id))
        edges_meta["start"].append(int(e.start))
        edges_meta["length"].append(int(len(e.tokens)))
        if e.is_leaf:
            leaves.append(int(e.edge_id))
    num_edges = len(edges_meta["parent"])
    header = _header("tree", capture, dtype, shard_tokens)
    header["tree"] = {"num_edges": num_edges, "unique_tokens": int(sum(edges_meta["length"])),
                      "num_leaves": len(leaves), "fingerprint": tree_fingerprint(tree.iter_edges()),
                      "leaves": leaves, **edges_meta}
    header["capture"] = {"chunk_tokens": chunk_tokens, "strategy": strategy}
    stats = TreeCaptureStats()
    t0 = time.perf_counter()
    with _dir_lock(out):
        index = _open_or_create(out, header, overwrite)
        sink = _ShardSink(out, index, dtype, len(capture.layer_ids), progress, num_edges)
        if not index["complete"]:
            stopped = False
            for e, sel, fin in iter_tree_features(tree, capture, start_edge=sink.next_segment, chunk_tokens=chunk_tokens,
                                                  strategy=strategy, cache_factory=cache_factory, stats=stats):
                sink.add(sel, fin, torch.tensor(np.asarray(e.tokens), dtype=torch.int32))
                if sink.pending_tokens >= shard_tokens:
                    sink.flush()
                    if stop_after_shards is not None and sink.written >= stop_after_shards:
                        stopped = True
                        break
            if not stopped:
                sink.flush()
                if sink.next_segment == num_edges:
                    index["complete"] = True
                    write_json_atomic(out / INDEX_FILE, index, compact=True)
    dt = time.perf_counter() - t0
    return CacheWriteResult(
        out_dir=str(out), kind="tree", complete=bool(index["complete"]), shards_total=len(index["shards"]),
        shards_written=sink.written, segments=num_edges, tokens_captured=sink.tokens,
        tokens_context=stats.tokens_context, padded_tokens=0, seconds=dt,
        tokens_per_s=sink.tokens / dt if dt > 0 else 0.0, bytes_per_token=sink.cached_bytes_per_token(),
    )


# ---------------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------------

class FeatureCacheReader:
    """Lazy reader of a feature cache; ``get(i)`` -> (selected ``[T, K*H]``, final_hidden ``[T, H]``).

    Segments are rows (``kind == "rows"``) or prefix-tree edges (``kind == "tree"``; assemble paths with
    :meth:`get_path` / :meth:`get_window`). Shards are opened with safetensors ``safe_open`` (memory
    mapped) and only the requested token range is read; up to ``max_open_shards`` handles are kept
    (LRU). Picklable (handles are reopened in the new process), so it can live in DataLoader workers.
    ``dataset``: if given, :meth:`check_dataset` runs first and a mismatch raises
    :class:`CacheMismatchError`.
    """

    def __init__(self, out_dir: str | os.PathLike, dataset=None, *, dtype: torch.dtype = torch.bfloat16,
                 require_complete: bool = True, max_open_shards: int = 64):
        self.out_dir = Path(out_dir)
        index_path = self.out_dir / INDEX_FILE
        if not index_path.exists():
            raise FileNotFoundError(f"no feature cache in {self.out_dir} ({INDEX_FILE} missing)")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != CACHE_FORMAT or self.index.get("version") != CACHE_VERSION:
            raise CacheMismatchError(f"{index_path}: not a {CACHE_FORMAT} v{CACHE_VERSION} index")
        if require_complete and not self.index.get("complete"):
            raise CacheMismatchError(f"{self.out_dir}: the capture is incomplete ({len(self.index['shards'])} shards); "
                                     "run the capture again to resume it")
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
        from safetensors import safe_open

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

    # -- tree caches ---------------------------------------------------------------------------------

    def _need_tree(self) -> None:
        if self.kind != "tree":
            raise TypeError(f"{self.out_dir} is a {self.kind!r} cache; paths need a prefix-tree cache")

    def leaf_edge(self, leaf_id: int) -> int:
        """Edge id of leaf ``leaf_id`` (DFS order, = TrainingPath.leaf_id)."""
        self._need_tree()
        return int(self._leaves[leaf_id])

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
        if not sel:
            d = dtype or self.dtype
            return torch.zeros(0, len(self.layer_ids) * self.hidden_size, dtype=d), torch.zeros(0, self.hidden_size, dtype=d)
        return torch.cat(sel), torch.cat(fin)

    def get_path_ids(self, edge_id: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        parts = [self._read(e, lo, hi, None, ids=True) for e, lo, hi in self._pieces(edge_id, start, end)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)

    def get_window(self, leaf_id: int, window_start: int, length: int, dtype: torch.dtype | None = None):
        """Features for a :class:`~data.prefix_tree.TrainingPath` (``leaf_id``, ``window_start``, len)."""
        return self.get_path(self.leaf_edge(leaf_id), window_start, window_start + length, dtype)

    # -- dataset check -------------------------------------------------------------------------------

    def check_dataset(self, dataset) -> None:
        """Raise :class:`CacheMismatchError` unless this cache was built for ``dataset``.

        Row caches: same row count, then the same ``input_ids`` fingerprint. Tree caches: every row
        (with ``provenance.leaf_id`` / ``window_start``, as made by ``PrefixTree.to_dataset``) must
        equal the cached tokens of its window.
        """
        if self.kind == "rows":
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
