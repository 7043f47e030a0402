"""Where a training batch's target features come from: the target itself, or the feature cache.

online: the target runs in the training process on every batch (no disk; the target's cost every epoch).
offline: the target runs once over the dataset into the on-disk cache (bf16 or FP8), then is freed;
training reads the cache. Both give the same `Captured` tensors for a batch.

The offline cache of a single-process run is captured by the run itself when it is missing. A
multi-process run only reads it: `dflash-pipeline prepare` (launched like training) captures it on
every rank first, so no rank waits in a barrier for a capture.
"""

from __future__ import annotations

import gc
import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from common.atomic_files import write_bytes_atomic, write_json_atomic
from configs.schema import PipelineConfig
from data.feature_cache import (
    INDEX_FILE,
    CacheMismatchError,
    EarlierFeatures,
    FeatureCacheReader,
    cache_complete,
    dataset_fingerprint,
    feature_cache_kwargs,
    write_feature_cache,
    write_row_tree_feature_cache,
)
from data.sources.mixture import regenerated_features
from drafters.drafter.objective import target_choices
from drafters.target.capture import Captured, make_capture
from drafters.target.fingerprint import target_fingerprint
from engines.settings import context_length
from engines.vllm.capture import EngineCapture
from train.batches import Batch
from train.setup import load_configured_target


class OnlineFeatures:
    def __init__(self, capture, device, with_final: bool):
        self.capture, self.device, self.with_final = capture, device, with_final

    def __call__(self, batch: Batch) -> Captured:
        return self.capture.capture(batch.input_ids.to(self.device), batch.attention_mask.to(self.device),
                                    with_final=self.with_final)


class OfflineFeatures:
    def __init__(self, reader, device, max_seq_len: int, with_final: bool, earlier: list[Path] | None = None):
        self.reader, self.device, self.max_seq_len, self.with_final = reader, device, max_seq_len, with_final
        self.earlier = earlier or []  # earlier caches of the same target (earlier_tree_caches): their rows' choices

    def __call__(self, batch: Batch) -> Captured:
        width = batch.input_ids.shape[1]
        lengths = batch.attention_mask.sum(1).tolist()
        rows = [self.reader.get_row(i, dtype=torch.bfloat16) for i in batch.indices]
        for i, n, (sel, _) in zip(batch.indices, lengths, rows):
            if len(sel) != n:
                raise CacheMismatchError(f"feature cache {self.reader.out_dir}: row {i} has {len(sel)} cached tokens, "
                                         f"the batch {n} (data.max_seq_len={self.max_seq_len})")
        selected = torch.zeros(len(rows), width, rows[0][0].shape[-1], dtype=torch.bfloat16)
        final = torch.zeros(len(rows), width, rows[0][1].shape[-1], dtype=torch.bfloat16) if self.with_final else None
        for b, (sel, fin) in enumerate(rows):
            selected[b, : len(sel)] = sel
            if final is not None:
                final[b, : len(fin)] = fin
        return Captured(selected.to(self.device), final.to(self.device) if final is not None else None)


CAPTURE_COMMAND = "accelerate launch -m scripts.cli prepare --config CONFIG [the same overrides]"


class FeatureCacheMissing(ValueError):
    """A multi-process run found no finished feature cache: the capture job makes it first."""


def cache_layout(config: PipelineConfig) -> str:
    """How the offline cache is captured: "tree" (the training rows merged into a prefix tree: every unique
    prefix token once, rows bounded by data.max_seq_len) for the in-process target, except on the
    regenerated stage-1 mixture, whose features regeneration kept per row ("rows"); "rows" for the engine,
    which has no KV-cache continuation."""
    return "rows" if config.target.feature_backend != "hf" or config.rows_from == "mixture" else "tree"


def feature_cache_dir(cache_root: Path, dataset_fingerprint: str, target_fingerprint: str, layer_ids: list[int],
                      dtype: str, layout: str, max_seq_len: int) -> Path:
    """Keyed on what the features are a function of: the target's content (not its path), the dataset's token
    ids and how they are captured and stored."""
    key = hashlib.sha256(f"{target_fingerprint}|{layer_ids}|{dtype}|{dataset_fingerprint}|{layout}|{max_seq_len}"
                         .encode()).hexdigest()[:12]
    return Path(cache_root) / "features" / f"cache-{key}"


def config_cache_dir(config: PipelineConfig, dataset, target_path: Path, layer_ids: list[int], cache_root: Path) -> Path:
    """The cache folder of this config and dataset (training and the capture job agree on it)."""
    return feature_cache_dir(cache_root, dataset_fingerprint(dataset), target_fingerprint(target_path, config.target.fingerprint),
                             layer_ids, config.features.dtype,
                             cache_layout(config), config.data.max_seq_len)


def earlier_tree_caches(config: PipelineConfig, target_path: Path, layer_ids: list[int], cache_root: Path,
                        out_dir: Path) -> list[Path]:
    """Finished tree caches of a dataset, other than ``out_dir``, captured from this target's content with these
    layers and dtype (their folder is the key of those settings and their own dataset), the largest first."""
    target = target_fingerprint(target_path, config.target.fingerprint)
    found = []
    for folder in sorted((Path(cache_root) / "features").glob("cache-*")):
        if folder == out_dir or not cache_complete(folder):
            continue
        index = json.loads((folder / INDEX_FILE).read_text())
        dataset = index.get("dataset")
        if index.get("kind") != "tree" or not dataset:
            continue
        key = feature_cache_dir(cache_root, dataset["fingerprint"], target, layer_ids, config.features.dtype, "tree",
                                dataset["max_seq_len"])
        if key == folder:
            found.append((index["tree"]["unique_tokens"], folder))
    return [folder for _, folder in sorted(found, key=lambda t: -t[0])]


def capture_feature_cache(config: PipelineConfig, dataset, target_path: Path, layer_ids: list[int], cache_root: Path,
                          device, *, rank: int = 0, world_size: int = 1, log=print) -> dict:
    """Capture (or resume) this rank's share of the offline cache; returns what it cost, as a dict.

    ``target_tokens``: positions the target ran (features stored + KV context rebuilt + padding).
    ``cached_tokens``: what the finished cache holds (a tree: the rows' unique tokens); ``row_tokens``:
    what capturing every row on its own would have run.
    """
    layout = cache_layout(config)
    out_dir = config_cache_dir(config, dataset, target_path, layer_ids, cache_root)
    if cache_complete(out_dir):
        return {"cache": str(out_dir), "layout": layout, "complete": True, "target_tokens": 0}
    if config.target.feature_backend == "vllm":  # the engine captures: the target's body is never loaded here

        # A row of max_seq_len tokens plus the one token vLLM must be allowed to generate.
        needed = config.data.max_seq_len + 1
        target, capture = None, EngineCapture(target_path, layer_ids, with_final=True, engine=config.target,
                                              max_model_len=context_length(config.target, needed, "feature capture"))
    else:
        target = load_configured_target(config, target_path, device)
        capture = make_capture(config.target.feature_backend, target, layer_ids)
    known = _regenerated(config, target_path, layer_ids, cache_root) if layout == "rows" else None
    if known is not None and hasattr(capture, "known_features"):
        capture.known_features = known.lookup
    else:
        known = None
    where = f" rank {rank}/{world_size}" if world_size > 1 else ""
    log(f"[features]{where} offline cache ({config.features.dtype}, {layout}) -> {out_dir}")
    common = dict(max_seq_len=config.data.max_seq_len, rank=rank, world_size=world_size,
                  **feature_cache_kwargs(config.features))
    if layout == "tree":
        earlier = EarlierFeatures(earlier_tree_caches(config, target_path, layer_ids, cache_root, out_dir)
                                  if config.features.reuse_earlier else [])
        if earlier.sources:
            log(f"[features]{where} copying what {len(earlier.sources)} earlier cache(s) hold: {', '.join(earlier.sources)}")
        result = write_row_tree_feature_cache(dataset, capture, out_dir, known=earlier, **common)
    else:
        result = write_feature_cache(dataset, capture, out_dir, pad_token_id=0, **common)
    report = {"cache": str(out_dir), "layout": layout, "rank": rank, "world_size": world_size, **result.to_dict()}
    if layout == "tree":
        report.update(reused_from=earlier.sources)
    forwarded = getattr(capture, "forwarded_tokens", None)
    report["target_tokens"] = forwarded if forwarded is not None else (
        result.tokens_captured + result.tokens_context + result.padded_tokens)
    log(f"[features]{where} target ran on {report['target_tokens']} tokens; the cache holds {result.cached_tokens} "
        f"(rows: {result.row_tokens}){'' if result.complete else '; other ranks are still capturing'}")
    capture.remove()  # the hooks reference the model: drop them so the target can be freed
    del capture, target
    gc.collect()
    return report


def feature_source(config: PipelineConfig, dataset, target_path: Path, layer_ids: list[int], accelerator, cache_root: Path):
    with_final = config.train.loss in ("kl", "ce_target") or config.train.anchor_scope == "sequence"
    if config.features.mode == "online":
        if config.target.feature_backend == "vllm":
            raise ValueError("vLLM captures features offline (target.backend / target.capture_backend: vllm): "
                             "set features.mode: offline")
        target = load_configured_target(config, target_path, accelerator.device)
        capture = make_capture(config.target.feature_backend, target, layer_ids, output_device=accelerator.device)
        return OnlineFeatures(capture, accelerator.device, with_final)

    out_dir = config_cache_dir(config, dataset, target_path, layer_ids, cache_root)
    if not cache_complete(out_dir):
        if accelerator.num_processes > 1:
            # Capturing here would leave every other rank waiting in a barrier for the whole capture.
            raise FeatureCacheMissing(
                f"the offline feature cache {out_dir} is not complete; capture it first on every GPU with the same "
                f"config and overrides: {CAPTURE_COMMAND} (resumable), then start training again")
        report = capture_feature_cache(config, dataset, target_path, layer_ids, cache_root, accelerator.device,
                                       log=accelerator.print)
        write_json_atomic(Path(config.output_dir) / "feature_capture.json", report)
    reader = FeatureCacheReader(out_dir, dataset)
    earlier = (earlier_tree_caches(config, target_path, layer_ids, cache_root, out_dir)
               if config.features.reuse_earlier and reader.kind == "tree" else [])
    return OfflineFeatures(reader, accelerator.device, config.data.max_seq_len, with_final, earlier)


def _regenerated(config: PipelineConfig, target_path: Path, layer_ids: list[int], cache_root: Path):
    """Features the mixture's regeneration kept (stage 1 on the general mixture only)."""
    if config.rows_from != "mixture":
        return None

    return regenerated_features(config.data, config.target, target_path, cache_root, layer_ids)


class TargetChoices:
    """Per dataset row, the target's greedy next token after every position (drafters.drafter.objective.target_choices).

    Computed from the batch's final hidden states the first time a row is seen and kept (an int32 per
    token): later epochs skip that vocabulary projection. Each row is computed alone, unpadded, so the
    result does not depend on which batch first saw it (a resumed run gets the same values).

    store: a file beside an offline feature cache. Once every row is known they are written there (by the
    process that `writes`), and a later run on the same cache and the same lm_head (its sha256 is in the
    file) reads them instead of projecting every cached position again.

    next_token_spans: per row, positions [lo, hi) whose choice is simply the next token, because the target
    wrote it greedily (data.sources.mixture.greedy_response_spans): the decode step already paid for that argmax.

    earlier: earlier caches of the same target (a grown set of sessions): a row whose tokens equal a row of theirs
    takes that row's stored choices, made with the same lm_head, instead of projecting it again.
    """

    def __init__(self, lm_head_weight: torch.Tensor, chunk_rows: int, *, store: Path | None = None,
                 num_rows: int | None = None, writes: bool = True,
                 next_token_spans: list[tuple[int, int]] | None = None, earlier: list[Path] | None = None):
        self.lm_head_weight, self.chunk_rows = lm_head_weight, chunk_rows
        self.next_token_spans = next_token_spans
        self.projected_positions = 0  # positions this object ran through the lm_head
        self.copied_positions = 0  # positions whose choices came from an earlier cache's row
        self.rows: dict[int, torch.Tensor] = {}
        self.store, self.num_rows, self.writes = store, num_rows, writes
        self.head_sha256 = _weight_sha256(lm_head_weight) if store else None
        self.loaded = store is not None and self._load()
        self.earlier = {} if self.loaded or not earlier else _earlier_choices(earlier, self.head_sha256)

    def _load(self) -> bool:
        if not self.store.exists():
            return False
        with safe_open(str(self.store), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("lm_head_sha256") != self.head_sha256 or int(meta.get("num_rows", -1)) != self.num_rows:
                return False
            tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets").tolist()
        self.rows = {i: tokens[offsets[i]:offsets[i + 1]] for i in range(self.num_rows)}
        return True

    def _save(self) -> None:
        rows = [self.rows[i] for i in range(self.num_rows)]
        offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
        write_bytes_atomic(self.store, save({"tokens": torch.cat(rows), "offsets": offsets},
                                            metadata={"lm_head_sha256": self.head_sha256, "num_rows": str(self.num_rows)}))

    def __call__(self, batch: Batch, captured: Captured) -> torch.Tensor:
        """[Bsz, T] long (padding: -1)."""
        lengths = batch.attention_mask.sum(1).tolist()
        computed = False
        for b, i in enumerate(batch.indices):
            if i not in self.rows:
                n = int(lengths[b])
                copied = self.earlier.get(_ids_key(batch.input_ids[b, :n])) if self.earlier else None
                if copied is not None:
                    self.rows[i] = copied
                    self.copied_positions += n
                    computed = True
                    continue
                lo, hi = self.next_token_spans[i] if self.next_token_spans is not None else (0, 0)
                lo, hi = max(lo, 0), min(hi, n - 1)
                projected = torch.ones(n, dtype=torch.bool)
                choices = torch.empty(n, dtype=torch.int32)
                if hi > lo:
                    projected[lo:hi] = False
                    choices[lo:hi] = batch.input_ids[b, lo + 1 : hi + 1].to(torch.int32)
                hidden = captured.final_hidden[b, :n][projected.to(captured.final_hidden.device)]
                choices[projected] = target_choices(hidden[None], self.lm_head_weight, self.chunk_rows)[0].to(
                    device="cpu", dtype=torch.int32)
                self.projected_positions += len(hidden)
                self.rows[i] = choices
                computed = True
        if computed and self.store is not None and self.writes and len(self.rows) == self.num_rows:
            self._save()
        out = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
        for b, i in enumerate(batch.indices):
            row = self.rows[i]
            out[b, : len(row)] = row
        return out.to(captured.final_hidden.device)


def _ids_key(ids: torch.Tensor) -> bytes:
    return hashlib.blake2b(ids.to(torch.int32).contiguous().numpy().tobytes(), digest_size=16).digest()


def _earlier_choices(cache_dirs: list[Path], head_sha256: str) -> dict[bytes, torch.Tensor]:
    """Stored choices of the earlier caches' rows (made with this lm_head), by the content of the row's tokens."""
    by_ids: dict[bytes, torch.Tensor] = {}
    for folder in cache_dirs:
        store = Path(folder) / "target_choices.safetensors"
        if not store.exists():
            continue
        with safe_open(str(store), framework="pt") as f:
            if (f.metadata() or {}).get("lm_head_sha256") != head_sha256:
                continue
            tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets").tolist()
        reader = FeatureCacheReader(folder)
        for r in range(reader.num_rows):
            by_ids.setdefault(_ids_key(reader.row_ids(r)), tokens[offsets[r]:offsets[r + 1]])
    return by_ids


def _weight_sha256(weight: torch.Tensor, rows: int = 4096) -> str:
    """sha256 over a weight's dtype (bf16 and fp32 argmaxes differ at near-ties) and its raw bytes, a block of
    rows at a time: a Kimi-size head (163,840 x 7,168) is never copied whole."""
    digest = hashlib.sha256(str(weight.dtype).encode())
    for block in weight.detach().split(rows):
        digest.update(block.contiguous().cpu().view(torch.uint8).numpy())
    return digest.hexdigest()


def choices_store(features_of) -> Path | None:
    """Where the target's greedy choices of an offline cache's rows are kept (None: online features)."""
    return Path(features_of.reader.out_dir) / "target_choices.safetensors" if isinstance(features_of, OfflineFeatures) else None
