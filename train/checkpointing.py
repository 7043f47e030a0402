"""Training checkpoints: atomic, keep-last-N, full resume that never unpickles.

Layout of one checkpoint, `<output_dir>/checkpoints/step-000120/`:
  state/              the training state (below)
  drafter/            the drafter in the serving format (what eval, export, SGLang and vLLM load)
  trainer_state.json  step, epoch, position in the epoch, metrics
  run_config.json     the run's whole config: a resume compares it with its own (config_drift)
Each is written under a temporary name and renamed into place, so a killed job never leaves a
half-written checkpoint under a real name; the newest complete one is what a resume picks up.

state/ holds JSON and safetensors only: model.safetensors (fp32 weights), optimizer.{json,safetensors},
scheduler.json, rng-<rank>.{json,safetensors} (python, numpy and torch generators of every process). A
resume reads nothing else and refuses a checkpoint that holds any pickle (unpickling runs code, and
checkpoint folders get copied between people and buckets) unless `train.trust_checkpoint_pickles`, and
refuses one that holds a symlink anywhere, that flag or not. Without the flag, no loader that unpickles
runs, whatever the folder holds or lacks. DeepSpeed is the exception: its engine writes (and reads) its model and optimizer state with pickle, so
state/ is accelerate's save_state there, and resuming a DeepSpeed run needs that flag.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file

from common.atomic_files import replace_folder
from configs.schema import ConfigError, PipelineConfig, migrate_settings
from drafters.drafter.checkpoint import (  # noqa: F401  (the layout)
    STEP_DIR,
    checkpoints_dir,
    latest_checkpoint,
    list_checkpoints,
)
from train.divergence import prunable

RUN_CONFIG = "run_config.json"
PICKLE_SUFFIXES = {".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt"}
# Settings a resume may change: where and how often things are written or logged, and what only other
# commands read. Everything else changes what the run computes.
SAFE_TO_CHANGE = (
    "run_name", "output_dir", "cache_dir", "logging.", "eval.", "retrain.", "target.device_map",
    # where and how the engine runs, not what it computes
    "target.tensor_parallel", "target.pipeline_parallel", "target.expert_parallel", "target.memory_share",
    "target.max_model_len", "target.fingerprint", "data.mixture.accept_fewer",
    "features.shard_tokens", "features.reuse_earlier", "train.save_every", "train.keep_last", "train.log_every",
    "train.cpu_threads",
    "train.resume", "train.trust_checkpoint_pickles", "train.resume_allow_config_change",
    "train.max_nonfinite_steps", "train.snapshot_every", "train.divergence_loss_factor",
    "train.divergence_grad_norm_factor", "train.divergence_weight_norm_factor", "train.divergence_patience",
)


class ResumeRefused(ConfigError):
    """A checkpoint this run will not resume from as configured; the message names the setting that allows it."""


@dataclass
class TrainerState:
    step: int = 0              # optimizer steps taken
    epoch: int = 0             # current epoch
    batch_in_epoch: int = 0    # micro-batches of this epoch already consumed
    elapsed_seconds: float = 0.0  # wall time of the run so far, data and feature preparation included
    metrics: dict = field(default_factory=dict)
    healthy: bool = True       # written outside a run of climbing losses (train/divergence.py)
    guard: dict = field(default_factory=dict)  # the divergence guard's moving averages, for an exact resume


def read_trainer_state(checkpoint: Path) -> TrainerState:
    return TrainerState(**json.loads((checkpoint / "trainer_state.json").read_text()))


# --------------------------------------------------------------------------------------------------
# Pickle-free state: a JSON structure whose tensors live in a safetensors file next to it
# --------------------------------------------------------------------------------------------------


def _encode(obj, tensors: dict):
    # Tagged so that tuples and int dict keys (optimizer state is keyed by parameter index) survive JSON.
    if isinstance(obj, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = obj.detach().cpu().contiguous()
        return {"tensor": key}
    if isinstance(obj, np.ndarray):
        return {"ndarray": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {"dict": [[k, _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_encode(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"{type(obj).__name__} has no pickle-free form")


def _decode(node, tensors: dict):
    (kind, value), *_ = node.items()
    if kind == "tensor":
        return tensors[value]
    if kind == "ndarray":
        return np.array(value, dtype=node["dtype"])
    if kind == "dict":
        return {k: _decode(v, tensors) for k, v in value}
    if kind in ("list", "tuple"):
        items = [_decode(v, tensors) for v in value]
        return tuple(items) if kind == "tuple" else items
    return value


def save_tree(folder: Path, name: str, obj) -> None:
    tensors: dict = {}
    structure = _encode(obj, tensors)
    if tensors:
        save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(structure))


def load_tree(folder: Path, name: str):
    tensors = load_file(str(folder / f"{name}.safetensors")) if (folder / f"{name}.safetensors").exists() else {}
    return _decode(json.loads((folder / f"{name}.json").read_text()), tensors)


def rng_state(accelerator) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "accelerator_step": accelerator.step}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(accelerator, state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    accelerator.step = state["accelerator_step"]


def is_deepspeed(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


# --------------------------------------------------------------------------------------------------
# Save and resume
# --------------------------------------------------------------------------------------------------


def save_checkpoint(accelerator, output_dir: str | Path, state: TrainerState, save_drafter, keep_last: int, *,
                    model, optimizer, scheduler, run_config: dict) -> Path:
    """Collective: every process calls it. save_drafter(path) writes the serving-format drafter."""
    folder = checkpoints_dir(output_dir)
    final = folder / f"step-{state.step:06d}"
    tmp = folder / f".tmp-step-{state.step:06d}"
    state_dir = tmp / "state"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        state_dir.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if is_deepspeed(accelerator):
        accelerator.save_state(str(state_dir))
    elif accelerator.is_main_process:  # DDP replicas hold the same weights and optimizer state
        weights = accelerator.unwrap_model(model).state_dict()
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(state_dir / "model.safetensors"))
        save_tree(state_dir, "optimizer", optimizer.state_dict())
    if accelerator.is_main_process:
        save_tree(state_dir, "scheduler", scheduler.state_dict())
    save_tree(state_dir, f"rng-{accelerator.process_index}", rng_state(accelerator))
    save_drafter(tmp / "drafter")  # gathers weights on every process, writes on the main one
    accelerator.wait_for_everyone()  # every rank's part of state/ is on disk before the rename
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
        (tmp / RUN_CONFIG).write_text(json.dumps(run_config, indent=2))
        replace_folder(tmp, final)
        for old in prunable(output_dir, keep_last):  # never the last good one
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def symlinks(checkpoint: Path) -> list[Path]:
    """Symlinks at or under a checkpoint folder, folders included (a symlinked folder is not descended into:
    whatever it points at is outside what was checked)."""
    if checkpoint.is_symlink():
        return [checkpoint]
    found = []
    for root, dirs, files in os.walk(checkpoint, followlinks=False):
        found += [Path(root) / name for name in dirs + files if (Path(root) / name).is_symlink()]
    return sorted(found)


def pickle_files(checkpoint: Path) -> list[Path]:
    """Files of a checkpoint that some loader would unpickle: by name, or (anything but JSON and
    safetensors) by content: pickle protocol 2+ or torch.save's zip format. Symlinks are not followed
    (check_resumable refuses them)."""
    found = []
    for root, _, files in os.walk(checkpoint, followlinks=False):
        for name in files:
            path = Path(root) / name
            if path.is_symlink() or path.suffix in (".json", ".safetensors"):
                continue
            with open(path, "rb") as f:
                head = f.read(4)
            if path.suffix in PICKLE_SUFFIXES or head[:1] == b"\x80" or head == b"PK\x03\x04":
                found.append(path)
    return sorted(found)


def _names(checkpoint: Path, paths: list[Path]) -> str:
    shown = [str(p.relative_to(checkpoint)) if p != checkpoint else str(p) for p in paths[:5]]
    return ", ".join(shown) + (f" (+{len(paths) - 5} more)" if len(paths) > 5 else "")


def check_resumable(checkpoint: Path, trusted: bool, deepspeed: bool, log) -> None:
    """Refuse a checkpoint holding a symlink (always: what it points at was never checked) or, unless
    train.trust_checkpoint_pickles, any pickle. Called before any training work and again right before loading."""
    links = symlinks(checkpoint)
    if links:
        where = "; ".join(f"{_names(checkpoint, [p])} -> {os.readlink(p)}" for p in links[:5])
        raise ResumeRefused(f"refusing to resume from {checkpoint}: it holds symlink(s) ({where}). A checkpoint this "
                            "pipeline writes has none, and a link can smuggle in files no check has seen. Copy the "
                            "real files in (cp -rL) if you trust them")
    found = pickle_files(checkpoint)
    if not found:
        return
    names = _names(checkpoint, found)
    if trusted:
        log(f"[train] train.trust_checkpoint_pickles: {checkpoint} holds pickle file(s) {names}; trusted")
        return
    why = ("DeepSpeed writes its model and optimizer state with pickle" if deepspeed else
           "this pipeline writes none, so something else put them there")
    raise ResumeRefused(f"refusing to resume from {checkpoint}: it holds pickle file(s) {names}, and unpickling "
                        f"runs code ({why}). Resume only from a folder you trust, with train.trust_checkpoint_pickles=true")


def load_checkpoint(accelerator, checkpoint: Path, *, model, optimizer, scheduler, trusted: bool) -> TrainerState:
    """Restore model, optimizer, scheduler and RNG (collective). Every tensor is read with safetensors; the
    only loader that unpickles (accelerate's load_state: DeepSpeed, or a checkpoint from before state/ was
    pickle-free) runs only under train.trust_checkpoint_pickles."""
    deepspeed = is_deepspeed(accelerator)
    check_resumable(checkpoint, trusted, deepspeed, lambda _: None)  # again: the folder may have changed since the first check
    state_dir = checkpoint / "state"
    if not deepspeed and (state_dir / "optimizer.json").is_file():
        missing = [name for name in ("model.safetensors", "scheduler.json") if not (state_dir / name).is_file()]
        if missing:
            raise ResumeRefused(f"refusing to resume from {checkpoint}: state/ lacks {', '.join(missing)}")
        accelerator.unwrap_model(model).load_state_dict(load_file(str(state_dir / "model.safetensors")))
        optimizer.load_state_dict(load_tree(state_dir, "optimizer"))
    elif not trusted:
        what = "DeepSpeed's state is pickled" if deepspeed else "state/optimizer.json is missing"
        raise ResumeRefused(f"refusing to resume from {checkpoint}: {what}, and the only loader left "
                            "(accelerate's load_state) unpickles, which runs code. Resume only from a folder you "
                            "trust, with train.trust_checkpoint_pickles=true")
    else:
        if (state_dir / "custom_checkpoint_0.pkl").exists() and not (state_dir / "scheduler.json").exists():
            accelerator.register_for_checkpointing(scheduler)
        accelerator.load_state(str(state_dir))
    if (state_dir / "scheduler.json").exists():
        scheduler.load_state_dict(load_tree(state_dir, "scheduler"))
    rng = f"rng-{accelerator.process_index}"
    if (state_dir / f"{rng}.json").exists():
        set_rng_state(accelerator, load_tree(state_dir, rng))
    return read_trainer_state(checkpoint)


# --------------------------------------------------------------------------------------------------
# Config drift between a run's checkpoints and the run that resumes them
# --------------------------------------------------------------------------------------------------


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_drift(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(dotted key, saved value, current value) for every setting that differs."""
    saved = migrate_settings(saved)  # keys moved or respelled since the checkpoint was written
    try:  # settings added to the schema since the checkpoint was written take their defaults
        saved = PipelineConfig.model_validate(saved).model_dump(mode="json")
    except ValueError:
        pass
    old, new = _flatten(saved), _flatten(current)
    missing = "(absent)"
    return [(k, old.get(k, missing), new.get(k, missing)) for k in sorted(old.keys() | new.keys())
            if old.get(k, missing) != new.get(k, missing)]


def is_safe_change(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in SAFE_TO_CHANGE)


def check_config_drift(checkpoint: Path, config: PipelineConfig, log) -> None:
    """Refuse a resume whose settings change the run's meaning (listed by dotted key) unless
    train.resume_allow_config_change; safe changes are logged."""
    path = checkpoint / RUN_CONFIG
    if not path.exists():
        log(f"[train] WARNING: {checkpoint} has no {RUN_CONFIG} (written before it existed); settings not compared")
        return
    changes = config_drift(json.loads(path.read_text()), config.model_dump(mode="json"))
    safe = [c for c in changes if is_safe_change(c[0])]
    other = [c for c in changes if not is_safe_change(c[0])]
    lines = lambda items: "\n  ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in items)  # noqa: E731
    if safe:
        log(f"[train] resume: accepted setting change(s) that do not change the run:\n  {lines(safe)}")
    if not other:
        return
    architecture = any(k.startswith("drafter.") for k, _, _ in other)  # the saved weights fix it: no flag helps
    if config.train.resume_allow_config_change and not architecture:
        log(f"[train] resume: train.resume_allow_config_change: applying changed setting(s) from {checkpoint.name} on:\n  {lines(other)}")
        return
    way_out = ("The drafter's architecture cannot change under its saved weights: rerun with the old values or use "
               "a new output_dir" if architecture else "Rerun with the old values, use a new output_dir, or set "
               f"train.resume_allow_config_change=true to apply them from {checkpoint.name} on")
    raise ResumeRefused(f"refusing to resume from {checkpoint}: these settings differ from the ones its run was "
                        f"started with, and they change what it computes:\n  {lines(other)}\n{way_out}")
