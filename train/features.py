"""Where a training batch's target features come from: the target itself, or the feature cache.

online: the target runs in the training process on every batch (no disk; the target's cost every epoch).
offline: the target runs once over the dataset into the on-disk cache (bf16 or FP8), then is freed;
training reads the cache. Both give the same `Captured` tensors for a batch.
"""

from __future__ import annotations

import gc
import hashlib
import json
from pathlib import Path

import torch

from configs.schema import PipelineConfig
from drafters.capture import Captured, make_capture
from train.batches import Batch


class OnlineFeatures:
    def __init__(self, capture, device, with_final: bool):
        self.capture, self.device, self.with_final = capture, device, with_final

    def __call__(self, batch: Batch) -> Captured:
        return self.capture.capture(batch.input_ids.to(self.device), batch.attention_mask.to(self.device),
                                    with_final=self.with_final)


class OfflineFeatures:
    def __init__(self, reader, device, max_seq_len: int, with_final: bool):
        self.reader, self.device, self.max_seq_len, self.with_final = reader, device, max_seq_len, with_final

    def __call__(self, batch: Batch) -> Captured:
        width = batch.input_ids.shape[1]
        rows = [self.reader.get(i, dtype=torch.bfloat16, end=min(self.max_seq_len, self.reader.locate(i)[2]))
                for i in batch.indices]
        selected = torch.zeros(len(rows), width, rows[0][0].shape[-1], dtype=torch.bfloat16)
        final = torch.zeros(len(rows), width, rows[0][1].shape[-1], dtype=torch.bfloat16) if self.with_final else None
        for b, (sel, fin) in enumerate(rows):
            selected[b, : len(sel)] = sel
            if final is not None:
                final[b, : len(fin)] = fin
        return Captured(selected.to(self.device), final.to(self.device) if final is not None else None)


def feature_cache_dir(cache_root: Path, dataset_fingerprint: str, target_path: Path, layer_ids: list[int], dtype: str) -> Path:
    key = hashlib.sha256(f"{Path(target_path).resolve()}|{layer_ids}|{dtype}|{dataset_fingerprint}".encode()).hexdigest()[:12]
    return Path(cache_root) / "features" / f"cache-{key}"


def feature_source(config: PipelineConfig, dataset, target_path: Path, layer_ids: list[int], accelerator, cache_root: Path):
    from train.setup import load_target_model

    with_final = config.train.loss in ("kl", "ce_target") or config.train.anchor_scope == "sequence"
    if config.features.mode == "online":
        if config.target.backend == "vllm":
            raise ValueError("target.backend: vllm captures features offline: set features.mode: offline")
        target = load_target_model(config, target_path, accelerator.device)
        capture = make_capture(config.target.backend, target, layer_ids, output_device=accelerator.device)
        return OnlineFeatures(capture, accelerator.device, with_final)

    from data.feature_cache import FeatureCacheReader, dataset_fingerprint, write_feature_cache

    out_dir = feature_cache_dir(cache_root, dataset_fingerprint(dataset), target_path, layer_ids, config.features.cache_dtype)
    index = out_dir / "index.json"
    complete = index.exists() and json.loads(index.read_text()).get("complete", False)
    # The other ranks wait in a barrier meanwhile (train/dflash.py raises its timeout to 12 h); on a GPU
    # fleet, capturing the cache in a separate job first uses every GPU instead of one.
    with accelerator.main_process_first():
        if accelerator.is_main_process and not complete:
            if config.target.backend == "vllm":  # the engine captures: the target's body is never loaded here
                from data.engine_capture import EngineCapture

                target, capture = None, EngineCapture(target_path, layer_ids, with_final=True)
            else:
                target = load_target_model(config, target_path, accelerator.device)
                capture = make_capture(config.target.backend, target, layer_ids)
            known = _regenerated(config, target_path, layer_ids, cache_root)
            if known is not None and hasattr(capture, "known_features"):
                capture.known_features = known.lookup
            else:
                known = None
            accelerator.print(f"[features] offline cache ({config.features.cache_dtype}) -> {out_dir}")
            write_feature_cache(dataset, capture, out_dir, dtype=config.features.cache_dtype,
                                shard_tokens=config.features.shard_tokens, pad_token_id=0)
            if known is not None:
                accelerator.print(f"[features] {capture.reused_tokens} tokens' features kept from regeneration, "
                                  f"{capture.computed_tokens} computed by the target")
            capture.remove()  # the hooks reference the model: drop them so the target can be freed
            del capture, target
            gc.collect()
    reader = FeatureCacheReader(out_dir, dataset)
    return OfflineFeatures(reader, accelerator.device, config.data.max_seq_len, with_final)


def _regenerated(config: PipelineConfig, target_path: Path, layer_ids: list[int], cache_root: Path):
    """Features the mixture's regeneration kept (stage 1 on the general mixture only)."""
    if config.data.dataset is not None or config.train.stage != "general":
        return None
    from data.mixture import regenerated_features

    return regenerated_features(config, target_path, cache_root, layer_ids)


class TargetChoices:
    """Per dataset row, the target's greedy next token after every position (drafters.objective.target_choices).

    Computed from the batch's final hidden states the first time a row is seen and kept (an int32 per
    token): later epochs skip that vocabulary projection. Each row is computed alone, unpadded, so the
    result does not depend on which batch first saw it (a resumed run gets the same values).
    """

    def __init__(self, lm_head_weight: torch.Tensor, chunk_rows: int):
        self.lm_head_weight, self.chunk_rows = lm_head_weight, chunk_rows
        self.rows: dict[int, torch.Tensor] = {}

    def __call__(self, batch: Batch, captured: Captured) -> torch.Tensor:
        """[Bsz, T] long (padding: -1)."""
        from drafters.objective import target_choices

        lengths = batch.attention_mask.sum(1).tolist()
        for b, i in enumerate(batch.indices):
            if i not in self.rows:
                n = int(lengths[b])
                choices = target_choices(captured.final_hidden[b : b + 1, :n], self.lm_head_weight, self.chunk_rows)
                self.rows[i] = choices[0].to(device="cpu", dtype=torch.int32)
        out = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
        for b, i in enumerate(batch.indices):
            row = self.rows[i]
            out[b, : len(row)] = row
        return out.to(captured.final_hidden.device)
