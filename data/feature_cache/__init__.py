"""Offline target-feature cache: capture the target once, train many epochs from disk.

A DFlash drafter consumes, at every position, the K selected target layer outputs (``selected``,
``[T, K*H]``) and, for KL targets, the target's final normed hidden state (``final_hidden``, ``[T, H]``).
Running the target every epoch costs as much as the drafter step itself, so ``features.mode: offline``
captures them once into this cache.

Producers, one on-disk format, one reader (each module has one job):

* ``rows``: :func:`write_feature_cache` - one *segment* per dataset row (``kind = "rows"``), rows
  captured in length-sorted padded batches (padding dropped before storing).
* ``tree``: :func:`write_tree_feature_cache` - one segment per edge of a
  :class:`data.trajectory.prefix_tree.PrefixTree` (``kind = "tree"``); every unique token runs through the target
  ONCE, each edge continuing from its parent path's KV cache. :func:`write_row_tree_feature_cache` does
  this for a training dataset's rows merged into a tree: rows that share a prefix compute it once.
* ``reader``: :class:`FeatureCacheReader` - lazy, memory-mapped, dequantises to the requested dtype,
  serves rows (:meth:`~FeatureCacheReader.get_row`) or tree paths, refuses a dataset it was not built from.
* ``reuse``: :class:`EarlierFeatures` - a grown dataset's tree capture copies what earlier tree caches hold.
* ``store``: the folder (index, shard plan, one rank's atomic shard writer, resume, completion);
  ``quantization``: bf16 / FP8 storage; ``fingerprints``: content hashes of datasets and trees.

Every producer takes ``rank`` / ``world_size``: ranks capture contiguous blocks of one shard plan into
one folder with no communication (``dflash-pipeline prepare``). The on-disk format, crash safety and
resume are described in data/FEATURE_CACHE_FORMAT.md.
"""

from data.feature_cache.fingerprints import dataset_fingerprint, tree_fingerprint
from data.feature_cache.quantization import (
                                    CACHE_DTYPES,
                                    FP8_MAX,
                                    dequantize_fp8,
                                    feature_bytes_per_token,
                                    quantize_fp8,
)
from data.feature_cache.reader import FeatureCacheReader
from data.feature_cache.reuse import EarlierFeatures
from data.feature_cache.rows import feature_cache_kwargs, write_feature_cache
from data.feature_cache.store import (
                                    CACHE_FORMAT,
                                    CACHE_VERSION,
                                    INDEX_FILE,
                                    CacheMismatchError,
                                    CacheWriteResult,
                                    cache_complete,
)
from data.feature_cache.tree import (
                                    TreeCaptureStats,
                                    iter_tree_features,
                                    row_prefix_tree,
                                    write_row_tree_feature_cache,
                                    write_tree_feature_cache,
)

__all__ = [
    "CACHE_DTYPES",
    "CACHE_FORMAT",
    "CACHE_VERSION",
    "FP8_MAX",
    "CacheMismatchError",
    "CacheWriteResult",
    "EarlierFeatures",
    "FeatureCacheReader",
    "INDEX_FILE",
    "TreeCaptureStats",
    "cache_complete",
    "dataset_fingerprint",
    "dequantize_fp8",
    "feature_bytes_per_token",
    "feature_cache_kwargs",
    "iter_tree_features",
    "quantize_fp8",
    "row_prefix_tree",
    "tree_fingerprint",
    "write_feature_cache",
    "write_row_tree_feature_cache",
    "write_tree_feature_cache",
]
