"""Training batches: checked, truncated, deterministically ordered and sharded sequences.

The order of an epoch is a pure function of (seed, epoch), and each process takes every
num_processes-th batch, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from datasets import Dataset


class DatasetError(ValueError):
    """A training dataset that cannot train a drafter; the message names the dataset and the record."""


def check_training_dataset(dataset: Dataset, name: str, max_seq_len: int) -> None:
    missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
    if missing:
        raise DatasetError(f"dataset {name!r} lacks the column(s) {sorted(missing)}; it has {dataset.column_names}")
    if len(dataset) == 0:
        raise DatasetError(f"dataset {name!r} is empty")
    trainable = 0
    for row, (ids, mask) in enumerate(zip(dataset["input_ids"], dataset["loss_mask"])):
        if len(ids) != len(mask):
            raise DatasetError(f"dataset {name!r} record {row}: loss_mask has {len(mask)} entries for {len(ids)} input_ids")
        # An anchor needs two consecutive loss-mask tokens inside the training window.
        window = mask[:max_seq_len]
        if any(a and b for a, b in zip(window, window[1:])):
            trainable += 1
    if trainable == 0:
        raise DatasetError(
            f"dataset {name!r} has no loss-mask tokens to train on within max_seq_len={max_seq_len} "
            f"({len(dataset)} records, e.g. record 0); check that responses were generated and masked"
        )


@dataclass
class Batch:
    indices: list[int]           # dataset rows
    input_ids: torch.Tensor      # [Bsz, T] right-padded
    attention_mask: torch.Tensor # [Bsz, T]
    loss_mask: torch.Tensor      # [Bsz, T] bool, False on padding


def epoch_rows(dataset: Dataset, name: str, repeats: dict[str, int]) -> list[int]:
    """The rows one epoch visits: each once, and each row of a category in `repeats` that many times
    (oversampling a category the sources hold few prompts of)."""
    if not repeats:
        return list(range(len(dataset)))
    if "category" not in dataset.column_names:
        raise DatasetError(f"train.category_repeats needs a 'category' column; dataset {name!r} has {dataset.column_names}")
    categories = dataset["category"]
    absent = sorted(set(repeats) - set(categories))
    if absent:
        raise DatasetError(f"train.category_repeats names {absent}, which no row of dataset {name!r} has "
                           f"(its categories: {sorted(set(categories))})")
    return [row for row, category in enumerate(categories) for _ in range(repeats.get(category, 1))]


def epoch_batches(rows: list[int], batch_size: int, *, seed: int, epoch: int) -> list[list[int]]:
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    return [[rows[i] for i in order[start : start + batch_size]] for start in range(0, len(rows), batch_size)]


def shard_batches(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """Every process gets the same number of batches (the tail that does not divide is dropped)."""
    usable = len(batches) - len(batches) % world
    return batches[rank:usable:world]


def collate(dataset: Dataset, indices: list[int], max_seq_len: int, pad_id: int) -> Batch:
    rows = dataset.select(indices)
    ids = [r[:max_seq_len] for r in rows["input_ids"]]
    masks = [m[:max_seq_len] for m in rows["loss_mask"]]
    width = max(len(r) for r in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(ids), width), dtype=torch.long)
    loss_mask = torch.zeros((len(ids), width), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(ids, masks)):
        input_ids[i, : len(r)] = torch.tensor(r)
        attention[i, : len(r)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return Batch(indices=indices, input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask)
