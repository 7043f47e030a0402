"""Producer 2: a prefix tree, one segment per edge, every unique token run through the target once.

Edges are visited in DFS preorder and each continues from the KV cache of its parent path (absolute
position ids ``start + arange``). A root-to-leaf path, or any window of it, is the concatenation of its
edges' features. Two kinds of tree are captured:

* a tree of logged requests (:class:`data.trajectory.prefix_tree.PrefixTree` built from trajectories):
  :func:`write_tree_feature_cache`; paths carry full-context features;
* the rows of a training dataset merged into a tree (:func:`row_prefix_tree`):
  :func:`write_row_tree_feature_cache`. Each row is a root-to-node path of at most ``max_seq_len``
  tokens, so its features equal a plain capture of the row alone, and rows that share a prefix (the
  turns and sub-agents of one session) compute it once.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from data.feature_cache.fingerprints import iter_rows, scan_dataset, tree_fingerprint
from data.feature_cache.rows import bounded_lengths, dataset_header
from data.feature_cache.store import CacheWriteResult, ShardWriter, make_header
from data.trajectory.prefix_tree import PrefixTree
from drafters.target.capture import crop_cache


def default_cache_factory(capture) -> Callable[[], Any]:
    config = capture.model.config
    return lambda: DynamicCache(config=config)


def crop(cache, length: int) -> None:
    crop_cache(cache, length)


@dataclass
class TreeCaptureStats:
    tokens_computed: int = 0  # tokens whose features were produced (each unique token once)
    tokens_context: int = 0  # ancestor tokens re-run to rebuild a KV cache after skipping edges (resume, ranks)
    tokens_reused: int = 0  # tokens whose features were copied from an earlier cache (``known``), not computed
    forward_calls: int = 0
    strategy: str = ""


class _CroppedPath:
    """One KV cache, cropped back to each edge's start: a DFS step only returns to an ancestor, whose
    tokens are a prefix of the cache, so memory is one path's KV."""

    def __init__(self, make_cache, rerun):
        self.make_cache, self.rerun = make_cache, rerun
        self.cache = None
        self.cached = 0  # the cache holds the tokens of the path's first `cached` edges

    def pop(self, depth: int) -> None:
        self.cached = min(self.cached, depth)

    def push_skipped(self) -> None:
        pass

    def cache_for(self, path: list):
        if self.cache is None:
            self.cache, self.cached = self.make_cache(), 0
        last = path[self.cached - 1] if self.cached else None
        crop(self.cache, last.start + len(last.tokens) if last else 0)
        if self.cached < len(path):  # the KV of ancestors that were skipped
            self.rerun(path[self.cached:], self.cache)
        return self.cache

    def push_computed(self, edge, cache, depth: int) -> None:
        self.cached = depth


class _CopiedPath:
    """A deep-copied KV snapshot per non-leaf edge on the DFS path (O(depth) caches), for caches that
    cannot be cropped, e.g. sliding-window layers."""

    def __init__(self, make_cache, rerun):
        self.make_cache, self.rerun = make_cache, rerun
        self.snapshots: list = []  # the cache after path[i]; None for leaves and skipped edges

    def pop(self, depth: int) -> None:
        self.snapshots.pop()

    def push_skipped(self) -> None:
        self.snapshots.append(None)

    def cache_for(self, path: list):
        deepest = max((i for i, s in enumerate(self.snapshots) if s is not None), default=-1)
        cache = copy.deepcopy(self.snapshots[deepest]) if deepest >= 0 else self.make_cache()
        if deepest < len(path) - 1:  # the KV of ancestors that were skipped
            self.rerun(path[deepest + 1:], cache)
            self.snapshots[-1] = copy.deepcopy(cache)  # the parent's snapshot: its other children need no rebuild
        return cache

    def push_computed(self, edge, cache, depth: int) -> None:
        self.snapshots.append(None if edge.is_leaf else cache)


def _use_crop(strategy: str, make_cache) -> bool:
    if strategy != "auto":
        return strategy == "crop"
    probe = make_cache()
    # A sliding-window layer only keeps the last W positions: it cannot be cropped back once full.
    return bool(getattr(probe, "is_croppable", True)) and not any(getattr(probe, "is_sliding", []) or [])


def iter_tree_features(
    tree,
    capture,
    *,
    compute: Callable[[int], bool] | None = None,
    known: Callable[[list, Any], tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    chunk_tokens: int = 8192,
    strategy: str = "auto",
    cache_factory: Callable[[], Any] | None = None,
    stats: TreeCaptureStats | None = None,
):
    """Yield ``(edge, selected [n, K*H], final_hidden [n, H])`` per edge of ``tree`` in DFS preorder.

    Each edge runs at absolute positions ``start + arange(n)`` (in chunks of ``chunk_tokens``) on top
    of a KV cache holding exactly its ancestors' tokens, so every unique token is computed once.
    Edges with ``compute(edge_id)`` False are skipped (resume, another rank's shards); a computed edge
    whose ancestors were skipped re-runs them once, without output, to rebuild its cache
    (``stats.tokens_context``). ``known(path, edge)``: the edge's features from elsewhere (an earlier cache,
    :class:`data.feature_cache.reuse.EarlierFeatures`) or None; a known edge is yielded without running the
    target, and is treated like a skipped one for its descendants' KV cache.

    ``strategy``: ``"crop"`` keeps one cache cropped back to each edge's start (:class:`_CroppedPath`);
    ``"copy"`` keeps a snapshot per non-leaf edge on the path (:class:`_CopiedPath`); ``"auto"``: crop
    unless the cache has sliding-window layers or says it is not ``is_croppable``.
    """
    if strategy not in ("auto", "crop", "copy"):
        raise ValueError(f"unknown strategy {strategy!r}")
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    stats = stats if stats is not None else TreeCaptureStats()
    make_cache = cache_factory or default_cache_factory(capture)

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

    def rerun(edges: list, cache) -> None:
        tokens = np.concatenate([np.asarray(a.tokens) for a in edges])
        run(tokens, edges[0].start, cache, keep=False)
        stats.tokens_context += len(tokens)

    cached_path = None  # chosen at the first computed edge: a fully resumed tree builds no cache
    path: list = []  # DFS ancestor stack (TreeEdge): the current root-to-edge path
    for e in tree.iter_edges():
        while path and path[-1].edge_id != e.parent_id:
            path.pop()
            if cached_path is not None:
                cached_path.pop(len(path))
        if e.parent_id != -1 and not path:
            raise ValueError(f"edge {e.edge_id}: parent {e.parent_id} is not on the DFS path")
        if compute is not None and not compute(e.edge_id):
            path.append(e)
            if cached_path is not None:
                cached_path.push_skipped()
            continue
        copied = known(path, e) if known is not None else None
        if copied is not None:
            stats.tokens_reused += len(e.tokens)
            path.append(e)
            if cached_path is not None:
                cached_path.push_skipped()
            yield e, copied[0], copied[1]
            continue
        if cached_path is None:
            use_crop = _use_crop(strategy, make_cache)
            stats.strategy = "crop" if use_crop else "copy"
            cached_path = (_CroppedPath if use_crop else _CopiedPath)(make_cache, rerun)
            for _ in path:
                cached_path.push_skipped()
        work = cached_path.cache_for(path)
        if work.get_seq_length() != e.start:
            raise RuntimeError(f"edge {e.edge_id}: KV cache holds {work.get_seq_length()} tokens, the edge starts at {e.start}")
        sel, fin = run(np.asarray(e.tokens), e.start, work, keep=True)
        stats.tokens_computed += len(e.tokens)
        path.append(e)
        cached_path.push_computed(e, work, len(path))
        yield e, sel, fin


def tree_header(tree) -> dict:
    """The index's ``tree`` entry: per-edge parent / start / length (DFS order), leaves, fingerprint."""
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
    return {"num_edges": len(edges_meta["parent"]), "unique_tokens": int(sum(edges_meta["length"])),
            "num_leaves": len(leaves), "fingerprint": tree_fingerprint(tree.iter_edges()), "leaves": leaves, **edges_meta}


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
    rank: int = 0,
    world_size: int = 1,
    rows: dict | None = None,
    dataset: dict | None = None,
    known: Callable[[list, Any], tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> CacheWriteResult:
    """Capture a :class:`~data.trajectory.prefix_tree.PrefixTree`'s features once per unique token, one segment per edge.

    See :func:`iter_tree_features` for the KV reuse (``chunk_tokens``, ``strategy``,
    ``cache_factory``). Shards hold runs of edges in DFS order; rank ``rank`` of ``world_size``
    captures its block of them. A resumed run, or a rank whose block starts below the root, re-runs
    the first pending edge's ancestors once to rebuild its KV cache (``tokens_context``); no stored
    feature is computed twice. ``rows`` / ``dataset``: set by :func:`write_row_tree_feature_cache`.
    ``known``: features to copy instead of computing (:func:`iter_tree_features`).
    """
    header = make_header("tree", capture, dtype, shard_tokens)
    header["tree"] = tree_header(tree)
    header["rows"], header["dataset"] = rows, dataset
    header["capture"] = {"chunk_tokens": chunk_tokens, "strategy": strategy}
    stats = TreeCaptureStats()
    with ShardWriter(out_dir, header, header["tree"]["length"], rank=rank, world_size=world_size, overwrite=overwrite,
                     progress=progress) as writer:
        todo = list(writer.pending)
        if stop_after_shards is not None:
            todo = todo[:stop_after_shards]
        shard_of = np.full(header["tree"]["num_edges"], -1, np.int64)
        for s in todo:
            shard_of[writer.segments_of(s).start:writer.segments_of(s).stop] = s
        parts: list = []
        left = len(todo)
        features = iter_tree_features(tree, capture, compute=lambda i: shard_of[i] >= 0, known=known,
                                      chunk_tokens=chunk_tokens,
                                      strategy=strategy, cache_factory=cache_factory, stats=stats)
        for e, sel, fin in features if left else ():
            parts.append(writer.encode(sel, fin, torch.tensor(np.asarray(e.tokens), dtype=torch.int32)))
            s = int(shard_of[e.edge_id])
            if e.edge_id == writer.segments_of(s).stop - 1:
                writer.write(s, parts)
                parts, left = [], left - 1
                if not left:
                    break
        features.close()
        writer.finish()
        unique = header["tree"]["unique_tokens"]
        row_tokens = None if dataset is None else dataset["total_tokens"]
        return writer.result("tree", unique, row_tokens, tokens_context=stats.tokens_context,
                             tokens_reused=stats.tokens_reused)


def row_prefix_tree(dataset, max_seq_len: int | None = None):
    """``(tree, rows)``: the dataset's rows (cut to ``max_seq_len``) merged into a prefix tree, and where
    each row ends in it: ``rows = {"edge": [...], "length": [...]}`` (edge -1 for an empty row), so row r
    is the first ``length[r]`` tokens of the root-to-``edge[r]`` path."""
    tree = PrefixTree()
    for _, ids in iter_rows(dataset):
        tree.add(ids[:max_seq_len], np.empty(0, np.int32))
    n = len(dataset)
    edge, length = [-1] * n, [0] * n
    for e in tree.iter_edges():
        for offset, r in e.request_ends:
            edge[r], length[r] = int(e.edge_id), int(e.start + offset)
    return tree, {"edge": edge, "length": length}


def write_row_tree_feature_cache(dataset, capture, out_dir: str | os.PathLike, *, max_seq_len: int | None = None,
                                 **kwargs) -> CacheWriteResult:
    """A training dataset's features through its prefix tree: every unique (prefix, token) computed once.

    Rows are cut to their first ``max_seq_len`` tokens (what training reads; nothing beyond is computed
    or stored). :meth:`FeatureCacheReader.get_row` serves row r. ``kwargs``: as
    :func:`write_tree_feature_cache` (dtype, shard_tokens, rank, world_size, ...).
    """
    lengths, fingerprint = scan_dataset(dataset)
    tree, rows = row_prefix_tree(dataset, max_seq_len)
    if rows["length"] != bounded_lengths(lengths, max_seq_len).tolist():
        raise RuntimeError("the row tree does not reproduce every row's length")
    return write_tree_feature_cache(tree, capture, out_dir, rows=rows,
                                    dataset=dataset_header(lengths, fingerprint, max_seq_len), **kwargs)
