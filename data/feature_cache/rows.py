"""Producer 1: one segment per dataset row, rows captured in length-sorted padded batches."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from data.feature_cache.fingerprints import ids_chunk, scan_dataset
from data.feature_cache.store import CacheWriteResult, ShardWriter, make_header


def feature_cache_kwargs(features_config) -> dict[str, Any]:
    """``write_*_feature_cache`` keyword arguments from a ``configs.schema.FeaturesConfig``."""
    return {"dtype": features_config.dtype, "shard_tokens": int(features_config.shard_tokens)}


def dataset_header(dataset_lengths: np.ndarray, fingerprint: str, max_seq_len: int | None) -> dict:
    """The index's ``dataset`` entry: which rows, bounded how (cached lengths = min(length, max_seq_len))."""
    bounded = bounded_lengths(dataset_lengths, max_seq_len)
    return {"num_rows": int(len(dataset_lengths)), "total_tokens": int(bounded.sum()), "fingerprint": fingerprint,
            "max_seq_len": max_seq_len}


def bounded_lengths(lengths: np.ndarray, max_seq_len: int | None) -> np.ndarray:
    return lengths if max_seq_len is None else np.minimum(lengths, max_seq_len)


def batches_by_length(lengths: list[int], batch_size: int, max_batch_tokens: int) -> list[list[int]]:
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
    max_seq_len: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    stop_after_shards: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> CacheWriteResult:
    """Capture ``capture``'s features for every row of ``dataset`` (column ``input_ids``) into ``out_dir``.

    Rows are cut to their first ``max_seq_len`` tokens (what training reads; nothing beyond is
    computed or stored). Rows of one shard are run in length-sorted batches of up to ``batch_size``
    rows and ``max_batch_tokens`` padded tokens (right padding + attention mask, padding dropped before
    storing). Rank ``rank`` of ``world_size`` captures its block of the shard plan; a partial cache is
    resumed. ``stop_after_shards`` stops after that many shards were written by this call, leaving
    the cache exactly as a crash would.
    """
    lengths, fingerprint = scan_dataset(dataset)
    bounded = bounded_lengths(lengths, max_seq_len)
    header = make_header("rows", capture, dtype, shard_tokens)
    header["dataset"] = dataset_header(lengths, fingerprint, max_seq_len)
    header["capture"] = {"batch_size": batch_size, "max_batch_tokens": max_batch_tokens, "padding": "right",
                         "hf_fingerprint": getattr(dataset, "_fingerprint", None)}
    padded = 0
    reused_before = getattr(capture, "tokens_reused", 0)  # rows whose features regeneration already holds
    with ShardWriter(out_dir, header, bounded, rank=rank, world_size=world_size, overwrite=overwrite,
                     progress=progress) as writer:
        for shard_no in writer.pending:
            if stop_after_shards is not None and writer.written >= stop_after_shards:
                break
            rows = writer.segments_of(shard_no)
            parts, pad = capture_rows(dataset, capture, writer, rows.start, rows.stop, batch_size, max_batch_tokens,
                                      pad_token_id, max_seq_len)
            writer.write(shard_no, parts)
            padded += pad
        writer.finish()
        return writer.result("rows", int(bounded.sum()), int(bounded.sum()), padded_tokens=padded,
                             tokens_reused=getattr(capture, "tokens_reused", 0) - reused_before)


def capture_rows(dataset, capture, writer: ShardWriter, first: int, end: int, batch_size: int, max_batch_tokens: int,
                 pad_token_id: int, max_seq_len: int | None) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Storage-form features of rows [first, end) in row order, and the padding positions computed."""
    lengths, values = ids_chunk(dataset, first, end)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = [torch.from_numpy(values[offsets[i]:offsets[i + 1]][:max_seq_len]) for i in range(len(lengths))]
    lengths = [len(r) for r in rows]
    results: dict[int, dict[str, torch.Tensor]] = {}  # storage form: a shard never holds fp32 copies
    padded = 0
    for batch in batches_by_length(lengths, batch_size, max_batch_tokens):
        width = lengths[batch[0]]
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, i in enumerate(batch):
            ids[j, : lengths[i]] = rows[i]
            mask[j, : lengths[i]] = 1
        out = capture.capture(ids, attention_mask=None if bool(mask.all()) else mask)
        padded += int((mask == 0).sum())
        for j, i in enumerate(batch):
            n = lengths[i]
            results[i] = writer.encode(out.selected[j, :n], out.final_hidden[j, :n], rows[i])
        del out
    hidden = writer.header["hidden_size"]
    empty = (torch.zeros(0, writer.k * hidden), torch.zeros(0, hidden))
    # In row order; empty rows are stored with length 0.
    parts = [results.pop(i) if i in results else writer.encode(*empty, rows[i]) for i in range(len(rows))]
    return parts, padded
