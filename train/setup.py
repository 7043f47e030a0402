"""What a training run needs before its first step: the target, the drafter config, the dataset."""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset, load_from_disk

from common.dtypes import torch_dtype
from configs.paths import default_cache_dir
from configs.schema import PipelineConfig
from data.sources.mixture import build_mixture
from data.trajectory.dataset import build_trajectory_dataset
from drafters.drafter.checkpoint import find_drafter_folder, load_draft_config
from drafters.drafter.config import build_draft_config, choose_mask_token_id
from drafters.drafter.model import dflash_settings
from drafters.target.fingerprint import note_target, target_fingerprint
from drafters.target.loading import TargetLoadError, load_target_tokenizer
from drafters.target.loading import load_target_model as load
from drafters.target.testbed import prepare_testbed_target


def cache_root(config: PipelineConfig) -> Path:
    return Path(config.cache_dir) if config.cache_dir else default_cache_dir()


def resolve_target(config: PipelineConfig, log=print) -> Path:
    """The target folder; None in the config means the embedded testbed target, prepared on demand."""
    if config.target.path is None:
        path = prepare_testbed_target(cache_root(config))
    else:
        path = Path(config.target.path)
        if not (path / "config.json").exists():
            raise ValueError(f"target.path {path} is not a model folder (no config.json)")
    # Every cache built from the target is keyed on its content; hashing it here, once, says when it changed.
    note_target(cache_root(config), path, target_fingerprint(path, config.target.fingerprint), log)
    return path


def resolve_draft_config(config: PipelineConfig, target_path: Path, target_config):
    """The drafter section built for this target, the mask token chosen from its tokenizer when unset; refuses a
    target that does not fit (both values named)."""
    mask_token_id = config.drafter.mask_token_id
    if mask_token_id is None:
        try:
            tokenizer = load_target_tokenizer(target_path, config.target.trust_remote_code)
        except TargetLoadError:
            raise
        except (OSError, ValueError) as err:
            raise ValueError(f"drafter.mask_token_id is not set and the target at {target_path} has no tokenizer to choose one from ({err})") from None
        mask_token_id = choose_mask_token_id(tokenizer, target_config.vocab_size)
    return build_draft_config(config.drafter, target_config, mask_token_id)


def drafter_layer_ids(config: PipelineConfig, target_path: Path, target_config) -> list[int]:
    """The target layers the run's drafter reads: the stage-1 drafter's (train.init_from) or the drafter section's."""
    if config.train.init_from:
        return dflash_settings(load_draft_config(find_drafter_folder(config.train.init_from)))[0]
    return dflash_settings(resolve_draft_config(config, target_path, target_config))[0]


def load_configured_target(config: PipelineConfig, target_path: Path, device: torch.device):
    """The target as the config asks for it (dtype, device_map, trust_remote_code), on `device`."""
    device_map = config.target.device_map if device.type != "cpu" else None
    model = load(target_path, dtype=torch_dtype(config.target.dtype, device), device_map=device_map,
                 trust_remote_code=config.target.trust_remote_code)
    return model if device_map is not None else model.to(device)


def training_dataset(config: PipelineConfig, target_path: Path, accelerator, layer_ids: list[int] | None = None) -> Dataset:
    """The dataset of this stage: a prepared one, the regenerated mixture, or trajectory trees.

    layer_ids: the drafter's target layers; with the offline feature cache, regeneration keeps their
    features so that the cache does not run the target over regenerated tokens again."""
    if config.rows_from == "dataset":
        path = Path(config.data.dataset)
        if not path.exists():
            raise ValueError(f"data.dataset {path} does not exist")
        return load_from_disk(str(path))
    if config.rows_from == "mixture":
        # Features kept while regenerating: the in-process target's forwards (hf regeneration, hf capture).
        keep = (layer_ids if config.features.mode == "offline" and config.target.feature_backend == "hf"
                and config.generation_backend == "hf" else None)
        # Every process regenerates its share of the prompts (a single one: all of them).
        return build_mixture(config.data, config.target, target_path, cache_root(config), feature_layers=keep,
                             ranks=accelerator)
    with accelerator.main_process_first():
        return build_trajectory_dataset(config.data, config.target, target_path, cache_root(config),
                                    report_dir=Path(config.output_dir))
