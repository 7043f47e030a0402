"""The prepared dataset and its target features, written in each peer trainer's own offline format.

Every peer reads the same rows (our regenerated mixture plus its prefilled rows, truncated at
data.max_seq_len), the same loss mask and the same bf16 target features from our offline feature cache.
Nothing is recomputed: the tensors are the cache's, only laid out the way each peer's reader expects.

SpecForge (`specforge_hidden_states_v1`, read by specforge.runtime.data_plane.offline_reader): a folder of
`.ckpt` files, one per sample, each a torch.save dict of input_ids [T], loss_mask [T] and hidden_states
[T, K*H] (the K target layers concatenated, in the drafter's target_layer_ids order).

speculators (speculators.train.data.ArrowDataset with the "file" hidden-states backend): a datasets folder
with input_ids, loss_mask and seq_len columns, and hidden_states/hs_<i>.safetensors holding token_ids [T]
and hidden_states [T, K+1, H], whose last layer is the verifier's last hidden state BEFORE its final norm
(speculators applies the verifier's norm itself). Our cache keeps the normed state n = w * x / rms(x); the
pre-norm input x / rms(x) = n / w has rms 1, so the verifier's norm maps it back to n (to within its eps):
the target's logits are exactly the ones our trainer sees. speculators' loaders always hold out the last
(1 - train_data_ratio) of the rows for validation, so the export appends one copy of its first row as that
held-out row: with train_data_ratio = speculators_train_ratio(n) every exported sample trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DONE = "export.json"


def _rows(dataset, reader, max_seq_len: int):
    for i in range(len(dataset)):
        row = dataset[i]
        ids = torch.tensor(row["input_ids"][:max_seq_len], dtype=torch.long)
        mask = torch.tensor(row["loss_mask"][:max_seq_len], dtype=torch.bool)
        selected, final = reader.get_row(i, dtype=torch.bfloat16)
        if len(selected) != len(ids):
            raise ValueError(f"feature cache {reader.out_dir}: row {i} has {len(selected)} cached tokens, "
                             f"the dataset {len(ids)} (data.max_seq_len={max_seq_len})")
        yield i, ids, mask, selected, final


def _usable(mask: torch.Tensor) -> bool:
    """Both peers refuse a sample without two consecutive supervised tokens (an anchor and its first label)."""
    return bool((mask[:-1] & mask[1:]).any())


def export_specforge(dataset, reader, max_seq_len: int, out_dir: Path) -> dict:
    out_dir = Path(out_dir)
    if (out_dir / DONE).exists():
        return json.loads((out_dir / DONE).read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = skipped = tokens = 0
    for i, ids, mask, selected, _ in _rows(dataset, reader, max_seq_len):
        if not _usable(mask):
            skipped += 1
            continue
        # clone(): the row is a view of the cache's memory-mapped shard, and torch.save writes a view's whole
        # storage, the shard (378 MB a sample on the quickstart mixture, 63 GB by the 177th)
        torch.save({"input_ids": ids, "loss_mask": mask.long(), "hidden_states": selected.clone()},
                   out_dir / f"data_{i:06d}.ckpt")
        kept, tokens = kept + 1, tokens + len(ids)
    summary = {"format": "specforge_hidden_states_v1", "samples": kept, "skipped": skipped, "tokens": tokens}
    (out_dir / DONE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def export_speculators(dataset, reader, max_seq_len: int, final_norm_weight: torch.Tensor, out_dir: Path) -> dict:
    from datasets import Dataset
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if (out_dir / DONE).exists():
        return json.loads((out_dir / DONE).read_text())
    states = out_dir / "hidden_states"
    states.mkdir(parents=True, exist_ok=True)
    weight = final_norm_weight.float()
    if bool((weight == 0).any()):
        raise ValueError("the target's final norm has zero weights: its pre-norm states cannot be recovered from the cache")
    records, skipped, tokens = [], 0, 0
    for i, ids, mask, selected, final in _rows(dataset, reader, max_seq_len):
        if not _usable(mask):
            skipped += 1
            continue
        k = len(records)  # ArrowDataset maps dataset row k to hs_<k>.safetensors
        layers = selected.view(len(ids), -1, final.shape[-1])
        pre_norm = (final.float() / weight).to(torch.bfloat16)
        save_file({"token_ids": ids, "hidden_states": torch.cat([layers, pre_norm[:, None]], dim=1).contiguous()},
                  str(states / f"hs_{k}.safetensors"))
        records.append({"input_ids": ids.tolist(), "loss_mask": mask.long().tolist(), "seq_len": len(ids)})
        tokens += len(ids)
    if not records:
        raise ValueError("no exported sample has two consecutive supervised tokens")
    (states / f"hs_{len(records)}.safetensors").write_bytes((states / "hs_0.safetensors").read_bytes())
    Dataset.from_list(records + records[:1]).with_format("torch").save_to_disk(str(out_dir))
    summary = {"format": "speculators arrow + file hidden states", "samples": len(records), "skipped": skipped,
               "tokens": tokens, "validation_rows": 1}
    (out_dir / DONE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def speculators_train_ratio(samples: int) -> float:
    """train_data_ratio that trains the first `samples` rows of the export and validates on its last one."""
    return (samples + 0.5) / (samples + 1)
