"""The cache folder: its index, the shard plan, and one rank's writer (atomic shards, resume, completion).

Layout and crash safety are described in data/FEATURE_CACHE_FORMAT.md. In short: the index lists the
whole shard plan from the start (a pure function of the segment lengths and ``shard_tokens``); a shard
is done exactly when its file exists (it is renamed into place only once complete) and its header names
this cache; the index is marked complete by whichever rank finds every shard done. Ranks take
contiguous blocks of the plan, so any number of processes fill one cache without talking to each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.atomic_files import atomic_path, write_json_atomic
from common.locks import FileLock
from data.feature_cache.quantization import CACHE_DTYPES, FP8_MAX, encode_features

CACHE_FORMAT = "dflash-feature-cache"
CACHE_VERSION = 2
INDEX_FILE = "index.json"
# Index keys whose values must agree for a resume (everything that changes what the shards hold).
COMPAT_KEYS = ("format", "version", "kind", "dtype", "layer_ids", "hidden_size", "num_layers_selected",
               "shard_tokens", "target", "dataset", "tree", "rows")


class CacheMismatchError(ValueError):
    """The cache was built for different data, target or settings than it is used with."""


@dataclass
class CacheWriteResult:
    out_dir: str
    kind: str
    complete: bool  # every shard of the plan is on disk (this rank's and the others')
    shards_total: int  # shards in the plan
    shards_done: int  # shards on disk now
    shards_written: int  # by this call
    segments: int  # rows or edges in the cache
    rows: int | None  # dataset caches: the dataset's rows
    cached_tokens: int  # tokens the finished cache holds (a tree: its unique tokens)
    row_tokens: int | None  # dataset caches: the rows' tokens (bounded by max_seq_len), what per-row capture runs
    tokens_captured: int  # features computed and stored by this call
    tokens_reused: int  # features stored by this call but not computed: copied from an earlier cache (tree) or regeneration (rows)
    tokens_context: int  # tree only: ancestor tokens re-run to rebuild a KV cache (not stored)
    padded_tokens: int  # rows only: padding positions the target computed in batches
    seconds: float
    tokens_per_s: float
    bytes_per_token: float  # shard bytes on disk / cached tokens (complete caches)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def target_identity(capture) -> dict[str, Any]:
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


def hidden_size_of(capture) -> int:
    cfg = capture.model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(text.hidden_size)


def make_header(kind: str, capture, dtype: str, shard_tokens: int) -> dict:
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"unknown cache dtype {dtype!r} (expected one of {CACHE_DTYPES})")
    if shard_tokens < 1:
        raise ValueError("shard_tokens must be >= 1")
    layer_ids = list(capture.layer_ids)
    h = hidden_size_of(capture)
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
        "target": target_identity(capture),
        "dataset": None,
        "tree": None,
        "rows": None,
    }


def plan_shards(lengths, shard_tokens: int) -> list[tuple[int, int]]:
    """[(first, end)) segment ranges; a shard closes once it holds >= shard_tokens tokens."""
    plan, first, acc = [], 0, 0
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        acc += n
        if acc >= shard_tokens:
            plan.append((first, i + 1))
            first, acc = i + 1, 0
    if first < len(lengths):
        plan.append((first, len(lengths)))
    return plan


def rank_block(num_shards: int, rank: int, world_size: int) -> range:
    """The contiguous run of shard numbers rank ``rank`` of ``world_size`` captures."""
    return range(rank * num_shards // world_size, (rank + 1) * num_shards // world_size)


def shard_name(shard_no: int) -> str:
    return f"shard-{shard_no:05d}.safetensors"


def short_json(value: Any, limit: int = 120) -> str:
    s = json.dumps(value, default=str)
    return s if len(s) <= limit else s[:limit] + "..."


class ShardWriter:
    """One rank's writer: ``with ShardWriter(...) as w: for s in w.pending: ... w.write(s, parts)``.

    ``lengths``: tokens per segment (rows or edges), in order. The rank captures the shards of
    :func:`rank_block` that are not on disk yet (``pending``), each written atomically; then
    :meth:`finish` marks the index complete if every shard of the plan (any rank's) is done.
    """

    def __init__(self, out_dir: str | os.PathLike, header: dict, lengths, *, rank: int = 0, world_size: int = 1,
                 overwrite: bool = False, progress: bool = True):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of world_size={world_size} ranks")
        if overwrite and world_size > 1:
            raise ValueError("overwrite=True with several ranks would delete the other ranks' shards; "
                             "remove the cache folder first")
        self.out_dir = Path(out_dir)
        self.rank, self.world_size, self.progress, self.overwrite = rank, world_size, progress, overwrite
        lengths = [int(n) for n in lengths]
        self.plan = plan_shards(lengths, header["shard_tokens"])
        header["shards"] = [{"file": shard_name(s), "first": a, "lengths": lengths[a:b], "tokens": int(sum(lengths[a:b]))}
                            for s, (a, b) in enumerate(self.plan)]
        header["complete"] = False
        self.header = header
        self.key = "blake2b:" + hashlib.blake2b(json.dumps({k: header.get(k) for k in COMPAT_KEYS}, sort_keys=True,
                                                           default=str).encode(), digest_size=16).hexdigest()
        self.dtype, self.k = header["dtype"], header["num_layers_selected"]
        self.mine = rank_block(len(self.plan), rank, world_size)
        self.pending: list[int] = []
        self.index: dict = {}
        self.written = self.tokens = 0
        self.t0 = time.perf_counter()
        # Two jobs running the same rank would write the same shards: the second is refused at once.
        self.lock = FileLock(self.out_dir / f".lock-rank-{rank:05d}-of-{world_size:05d}",
                             f"another process is writing rank {rank}/{world_size} of the feature cache in {self.out_dir}")

    # -- opening ------------------------------------------------------------------------------------

    def __enter__(self) -> "ShardWriter":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.lock.__enter__()
        try:
            self.index = self.open_index()
            mine = {shard_name(s) for s in self.mine}
            for p in self.out_dir.iterdir():  # temp files (".<shard>.<random>.tmp") a killed writer of our block left
                if p.name.endswith(".tmp") and p.name[1:].rsplit(".", 2)[0] in mine:
                    p.unlink()
            self.pending = [s for s in self.mine if not self.index["complete"] and not self.shard_done(s, repair=True)]
        except BaseException:
            self.lock.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.lock.__exit__(*exc)

    def open_index(self) -> dict:
        """The folder's index if it is this cache's (resume), else a fresh one (refusing another cache's)."""
        path = self.out_dir / INDEX_FILE
        if path.exists() and not self.overwrite:
            try:
                index = json.loads(path.read_text())
            except json.JSONDecodeError as err:  # cannot happen with atomic writes; refuse to guess
                raise CacheMismatchError(f"{path} is not valid JSON ({err}); delete the folder") from None
            diffs = [k for k in COMPAT_KEYS if index.get(k) != self.header.get(k)]
            if diffs:
                raise CacheMismatchError(
                    f"{self.out_dir} holds a feature cache built with different {', '.join(diffs)} "
                    f"(e.g. {diffs[0]}: cached {short_json(index.get(diffs[0]))} vs requested "
                    f"{short_json(self.header.get(diffs[0]))}); use another directory or overwrite=True")
            if [(s["file"], s["first"], s["lengths"]) for s in index.get("shards", [])] != \
                    [(s["file"], s["first"], s["lengths"]) for s in self.header["shards"]]:
                raise CacheMismatchError(f"{path}: the shard plan differs from this capture's; delete the folder")
            return index
        if self.overwrite:
            for p in self.out_dir.iterdir():
                if p.is_file() and (p.name.startswith("shard-") or p.name.endswith(".tmp")):
                    p.unlink()
        index = dict(self.header)
        write_json_atomic(path, index, compact=True)  # every rank writes the same bytes: no race to lose
        return index

    # -- shards -------------------------------------------------------------------------------------

    def shard_done(self, shard_no: int, repair: bool = False) -> bool:
        """The shard's file is on disk and its header names this cache and this shard's segments."""
        path = self.out_dir / shard_name(shard_no)
        if not path.exists():
            return False
        entry = self.header["shards"][shard_no]
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
        except Exception:  # noqa: BLE001 - unreadable header: not a finished shard of ours
            meta = {}
        ok = meta.get("cache") == self.key and meta.get("first") == str(entry["first"]) and \
            meta.get("lengths") == json.dumps(entry["lengths"])
        if not ok and repair:
            path.unlink()
        return ok

    def segments_of(self, shard_no: int) -> range:
        a, b = self.plan[shard_no]
        return range(a, b)

    def encode(self, selected: torch.Tensor, final_hidden: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return encode_features(selected, final_hidden, ids, self.dtype, self.k)

    def write(self, shard_no: int, parts: list[dict[str, torch.Tensor]]) -> None:
        """Write shard ``shard_no`` from its segments' storage-form tensors (in segment order)."""
        entry = self.header["shards"][shard_no]
        got = [int(p["input_ids"].shape[0]) for p in parts]
        if got != entry["lengths"]:
            raise RuntimeError(f"shard {shard_no}: segments of {got} tokens, the plan says {entry['lengths']}")
        tensors = {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}
        meta = {"format": CACHE_FORMAT, "kind": self.header["kind"], "cache": self.key, "first": str(entry["first"]),
                "lengths": json.dumps(entry["lengths"])}
        with atomic_path(self.out_dir / entry["file"]) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        self.written += 1
        self.tokens += entry["tokens"]
        if self.progress:
            dt = time.perf_counter() - self.t0
            where = f"rank {self.rank}/{self.world_size} " if self.world_size > 1 else ""
            print(f"[feature-cache] {where}{entry['file']}: {self.header['kind']} "
                  f"{entry['first'] + len(entry['lengths'])}/{self.segments}, "
                  f"{self.tokens / max(dt, 1e-9):.0f} tok/s", file=sys.stderr, flush=True)

    @property
    def segments(self) -> int:
        return self.plan[-1][1] if self.plan else 0

    # -- completion ---------------------------------------------------------------------------------

    def finish(self) -> bool:
        """Mark the index complete once every shard of the plan is done (by any rank); True if complete."""
        path = self.out_dir / INDEX_FILE
        index = json.loads(path.read_text())
        if index.get("complete"):
            self.index = index
            return True
        if not all(self.shard_done(s) for s in range(len(self.plan))):
            return False
        for entry in index["shards"]:
            entry["bytes"] = int((self.out_dir / entry["file"]).stat().st_size)
        index["complete"] = True
        write_json_atomic(path, index, compact=True)  # two ranks finishing together write the same bytes
        self.index = index
        return True

    def result(self, kind: str, cached_tokens: int, row_tokens: int | None, *, tokens_context: int = 0,
               padded_tokens: int = 0, tokens_reused: int = 0) -> CacheWriteResult:
        complete = bool(self.index.get("complete"))
        done = len(self.plan) if complete else sum(self.shard_done(s) for s in range(len(self.plan)))
        shards = self.index.get("shards", [])
        stored = sum(s.get("bytes", 0) for s in shards)
        dt = time.perf_counter() - self.t0
        return CacheWriteResult(
            out_dir=str(self.out_dir), kind=kind, complete=complete, shards_total=len(self.plan), shards_done=done,
            shards_written=self.written, segments=self.segments,
            rows=self.header["dataset"]["num_rows"] if self.header.get("dataset") else None, cached_tokens=int(cached_tokens),
            row_tokens=None if row_tokens is None else int(row_tokens),
            tokens_captured=self.tokens - int(tokens_reused), tokens_reused=int(tokens_reused), tokens_context=int(tokens_context), padded_tokens=int(padded_tokens), seconds=dt,
            tokens_per_s=(self.tokens - int(tokens_reused)) / dt if dt > 0 else 0.0,
            bytes_per_token=stored / cached_tokens if complete and cached_tokens else 0.0,
        )


def segment_lengths(index: dict) -> np.ndarray:
    return np.asarray([n for s in index["shards"] for n in s["lengths"]], np.int64)


def cache_complete(out_dir: str | os.PathLike) -> bool:
    """True when ``out_dir`` holds a finished cache of this format (what training can read)."""
    path = Path(out_dir) / INDEX_FILE
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return index.get("format") == CACHE_FORMAT and index.get("version") == CACHE_VERSION and bool(index.get("complete"))
