"""Features that earlier tree caches already hold, so a grown dataset's capture copies them instead of
running the target again.

A cache is keyed on its whole dataset: stage 2 on 272 sessions plus 400 new ones gets a new cache, and
without this every earlier session would run through the target again. Features at a position depend only
on the tokens up to it, so an edge of the new tree whose whole root path is a path of an earlier tree can be
copied. An edge that has new descendants still runs once, as their KV context, exactly like an edge that
another rank stored (``iter_tree_features``).
"""

from __future__ import annotations

import numpy as np
import torch

from data.feature_cache.reader import FeatureCacheReader


class _Tree:
    """One earlier tree cache, walkable by tokens: (parent edge, first token) -> child edge."""

    def __init__(self, reader: FeatureCacheReader):
        self.reader = reader
        self.ids = [reader.get_ids(e).numpy() for e in range(len(reader))]
        parents = reader.index["tree"]["parent"]
        self.children = {(int(parents[e]), int(ids[0])): e for e, ids in enumerate(self.ids) if len(ids)}

    def pieces(self, path_tokens: np.ndarray, start: int, end: int) -> list[tuple[int, int, int]] | None:
        """The (edge, lo, hi) slices holding positions [start, end) of ``path_tokens``, or None where the
        earlier tree does not hold that prefix."""
        pos, parent, out = 0, -1, []
        while pos < end:
            edge = self.children.get((parent, int(path_tokens[pos])))
            if edge is None:
                return None
            ids = self.ids[edge]
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
