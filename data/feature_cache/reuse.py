"""Features that earlier tree caches already hold, so a grown dataset's capture copies them instead of
running the target again.

A cache is keyed on its whole dataset: stage 2 on 272 sessions plus 400 new ones gets a new cache, and
without this every earlier session would run through the target again. Features at a position depend only
on the tokens up to it, so an edge of the new tree whose whole root path is a path of an earlier tree can be
copied. An edge that has new descendants still runs once, as their KV context, exactly like an edge that
another rank stored (``iter_tree_features``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from data.feature_cache.reader import FeatureCacheReader


class _Tree:
    """One earlier tree cache, walkable by tokens: (parent edge, first token) -> child edge.

    It holds one sorted key per edge; edge ids are read when a walk reaches them (a bounded cache keeps the
    shared prefixes'), so a production cache's tokens are not all held in memory."""

    def __init__(self, reader: FeatureCacheReader, cached_edges: int = 1 << 16):
        self.reader = reader
        first = reader.first_ids()
        edges = np.nonzero(first >= 0)[0]
        keys = self._key(reader.parents[edges], first[edges])
        order = np.argsort(keys, kind="stable")
        self.keys, self.edges = keys[order], edges[order]
        self.ids = lru_cache(maxsize=cached_edges)(lambda e: reader.get_ids(e).numpy())

    @staticmethod
    def _key(parent, token):
        return ((np.asarray(parent, np.int64) + 1) << 32) | np.asarray(token, np.int64)

    def child(self, parent: int, token: int) -> int | None:
        key = self._key(parent, token)
        i = int(np.searchsorted(self.keys, key))
        return int(self.edges[i]) if i < len(self.keys) and self.keys[i] == key else None

    def pieces(self, path_tokens: np.ndarray, start: int, end: int) -> list[tuple[int, int, int]] | None:
        """The (edge, lo, hi) slices holding positions [start, end) of ``path_tokens``, or None where the
        earlier tree does not hold that prefix."""
        pos, parent, out = 0, -1, []
        while pos < end:
            edge = self.child(parent, int(path_tokens[pos]))
            if edge is None:
                return None
            ids = self.ids(edge)
            n = min(len(ids), end - pos)
            if not np.array_equal(ids[:n], path_tokens[pos:pos + n]):
                return None
            if pos + n > start:
                out.append((edge, max(start, pos) - pos, n))
            pos, parent = pos + len(ids), edge
        return out


class EarlierFeatures:
    """``known(path, edge)`` for :func:`iter_tree_features`: the edge's features copied from the first earlier
    cache that holds its root path, else None. The caller vouches that the caches came from the same target,
    layers and storage dtype (``train/features.py`` checks the cache keys)."""

    def __init__(self, cache_dirs):
        self.trees = [_Tree(FeatureCacheReader(d, dtype=torch.float32)) for d in cache_dirs]
        self.sources = [str(d) for d in cache_dirs]
        self.tokens_reused = 0

    def __call__(self, path: list, edge) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.trees or not len(edge.tokens):
            return None
        tokens = np.concatenate([np.asarray(a.tokens) for a in path] + [np.asarray(edge.tokens)])
        start, end = edge.start, edge.start + len(edge.tokens)
        for tree in self.trees:
            pieces = tree.pieces(tokens, start, end)
            if pieces is None:
                continue
            parts = [tree.reader.get(e, start=lo, end=hi) for e, lo, hi in pieces]
            self.tokens_reused += end - start
            return torch.cat([s for s, _ in parts]), torch.cat([f for _, f in parts])
        return None
