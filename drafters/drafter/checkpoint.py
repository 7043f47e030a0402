"""Save and load drafters in the reference DFlash format (what z-lab's package, SGLang and vLLM load).

A checkpoint folder holds config.json (Qwen3 fields, "architectures": ["DFlashDraftModel"],
"num_target_layers", "block_size", "dflash_config": {"mask_token_id", "target_layer_ids"}) and
model.safetensors with the draft weights only (no embed_tokens, no lm_head). Writes are atomic: the
folder is built under a temporary name next to the destination and moved into place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from common.atomic_files import atomic_folder
from drafters.drafter.config import validate_target
from drafters.drafter.model import DFlashDrafter

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TRAINER_STATE = "trainer_state.json"
STEP_DIR = re.compile(r"^step-(\d{6,})$")  # <output_dir>/checkpoints/step-000120 (train/checkpointing.py)


def config_dict(config: Qwen3Config, dtype: torch.dtype | None = None) -> dict:
    data = config.to_dict()
    data["architectures"] = ["DFlashDraftModel"]
    data["model_type"] = "qwen3"
    # transformers 4.x readers (older SGLang / vLLM) look for a top-level rope_theta.
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope:
        data.setdefault("rope_theta", rope["rope_theta"])
    if dtype is not None:
        data["dtype"] = str(dtype).removeprefix("torch.")
    return data


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors atomically; an existing folder is replaced."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu", dtype or t.dtype).contiguous() for name, t in drafter.state_dict().items()}
    stored_dtype = dtype or next(iter(state.values())).dtype
    with atomic_folder(out_dir) as tmp:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config_dict(drafter.config, stored_dtype), indent=2, sort_keys=True) + "\n")
    return out_dir


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete training checkpoints of an output_dir (`checkpoints/step-NNNNNN/` with a
    trainer_state.json), oldest first."""
    folder = checkpoints_dir(output_dir)
    if not folder.exists():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / TRAINER_STATE).exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def find_drafter_folder(path: str | Path) -> Path:
    """The one rule for naming a drafter: the reference-format folder behind a path, which may be the
    folder itself (config.json; an FP8 export is one too), a training checkpoint (its drafter/), or a
    training output_dir (its newest checkpoints/step-*/drafter). The folder must hold the weights."""
    path = Path(path)
    if (path / CONFIG_NAME).is_file():
        folder = path
    elif (path / "drafter" / CONFIG_NAME).is_file():
        folder = path / "drafter"
    elif (path / "checkpoints").is_dir() and latest_checkpoint(path) is not None:
        folder = latest_checkpoint(path) / "drafter"
    else:
        raise FileNotFoundError(f"{path} is not a drafter folder (no {CONFIG_NAME}), a training checkpoint "
                                f"(no drafter/{CONFIG_NAME}) or a training output_dir (no checkpoints/step-*)")
    if not (folder / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{folder} has {CONFIG_NAME} but no {WEIGHTS_NAME}")
    return folder


def load_draft_config(path: str | Path) -> Qwen3Config:
    return Qwen3Config.from_dict(json.loads((Path(path) / CONFIG_NAME).read_text()))


def load_drafter(path: str | Path, dtype: torch.dtype | None = None, device=None, target_config=None) -> DFlashDrafter:
    """Load a reference-format folder (in its stored dtype unless dtype is given); with target_config,
    check the fit first (ValueError)."""
    path = Path(path)
    config = load_draft_config(path)
    if target_config is not None:
        validate_target(config, target_config)
    drafter = DFlashDrafter(config)
    state = load_file(str(path / WEIGHTS_NAME), device=str(device or "cpu"))
    drafter.load_state_dict(state, strict=True, assign=True)
    if dtype is not None or device is not None:
        drafter.to(device=device, dtype=dtype)
    return drafter
