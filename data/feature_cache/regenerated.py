"""Target features kept while regenerating, so that no regenerated token runs through the target twice.

Regeneration already computes every hidden state of a prompt (the prefill) and of each generated token
(the decode steps). With `regenerate(..., feature_layers=[...])` forward hooks keep the chosen layers'
outputs and the final normed hidden state of those forwards (`drafters.target.capture.HFCapture.record_forwards`),
one safetensors file per regenerated batch, next to the batch's token shard:

    <out_dir>/features-<layer ids>/shard-NNNNNN.safetensors
        selected      [sum of row lengths, K*H]  the chosen layers, concatenated (the target's dtype)
        final_hidden  [sum of row lengths, H]
        metadata      {"row_keys": [...], "lengths": [...]}  (row_key: a hash of the row's token ids)

Building the feature cache then serves these rows from here (`RegeneratedFeatures.lookup`, plugged
into `HFCapture.known_features`) and runs the target only on rows it does not know: prefilled samples,
and batches regenerated before features were kept. Incremental decoding rounds differently from one
full forward, so the values match a separate capture within the dtype's tolerance, not bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.atomic_files import atomic_path
from drafters.target.capture import Captured

FEATURES_PREFIX = "features-"


def features_dir(out_dir: Path, layer_ids: list[int]) -> Path:
    return Path(out_dir) / (FEATURES_PREFIX + "-".join(str(i) for i in layer_ids))


def row_key(input_ids) -> str:
    ids = np.asarray(input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids, dtype=np.int64)
    return hashlib.sha256(ids.tobytes()).hexdigest()[:32]


def write_batch_features(path: Path, rows: list[tuple[list[int], torch.Tensor, torch.Tensor]]) -> None:
    """One regenerated batch: (input_ids, selected [T, K*H], final_hidden [T, H]) per row; atomic."""
    for ids, selected, final in rows:
        if not len(ids) == len(selected) == len(final):
            raise ValueError(f"features of {len(selected)} / {len(final)} positions for a row of {len(ids)} tokens")
    metadata = {"row_keys": json.dumps([row_key(ids) for ids, _, _ in rows]),
                "lengths": json.dumps([len(ids) for ids, _, _ in rows])}
    tensors = {"selected": torch.cat([s for _, s, _ in rows]).contiguous(),
               "final_hidden": torch.cat([f for _, _, f in rows]).contiguous()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


class RegeneratedFeatures:
    """Read side: row token ids -> the features kept for that row, or None (read lazily, one row at a time)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._files = {}
        self._where: dict[str, tuple[Path, int, int]] = {}
        for path in sorted(self.folder.glob("shard-*.safetensors")):
            handle = safe_open(str(path), framework="pt")
            meta = handle.metadata()
            self._files[path] = handle
            start = 0
            for key, length in zip(json.loads(meta["row_keys"]), json.loads(meta["lengths"])):
                self._where[key] = (path, start, start + length)
                start += length

    def __len__(self) -> int:
        return len(self._where)

    def lookup(self, input_ids: torch.Tensor):
        found = self._where.get(row_key(input_ids))
        if found is None:
            return None
        path, lo, hi = found
        handle = self._files[path]
        return Captured(handle.get_slice("selected")[lo:hi], handle.get_slice("final_hidden")[lo:hi])
