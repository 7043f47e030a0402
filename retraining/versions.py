"""Drafter versions: the first one (bootstrap), their exports, and going back to an earlier one (rollback)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from common.atomic_files import make_readable, write_json_atomic
from configs.schema import PipelineConfig
from drafters.drafter.checkpoint import find_drafter_folder, load_drafter, save_drafter
from drafters.drafter.model import DFlashDrafter
from drafters.export import contract
from drafters.export.exporter import export_drafter
from drafters.target.loading import load_target_config
from retraining.hooks import notify_engine
from retraining.state import (
    RetrainError,
    StateDir,
    commit,
    copy_tree_atomic,
    load_state,
    now_iso,
    read_jsonl,
    repair,
    state_lock,
)
from train.setup import resolve_draft_config, resolve_target


def initial_drafter(config: PipelineConfig, target_path: Path, target_config, out: Path, log) -> str:
    rc = config.retrain
    if rc.initial_drafter:
        src = find_drafter_folder(rc.initial_drafter)
        load_drafter(src, target_config=target_config)  # refuses a drafter that does not fit the target
        copy_tree_atomic(src, out)
        return str(src)
    draft_config = resolve_draft_config(config, target_path, target_config)
    torch.manual_seed(config.train.seed)
    save_drafter(DFlashDrafter(draft_config), out, dtype=torch.bfloat16)
    make_readable(out)
    log(f"[retrain] no retrain.initial_drafter: starting from a random drafter ({draft_config.num_hidden_layers} "
        f"layer(s), target layers {draft_config.dflash_config['target_layer_ids']})")
    return "random init (drafter section, seed train.seed)"


def export_all(config: PipelineConfig, drafter_dir: Path, version_dir: Path, card: dict) -> dict:
    rc = config.retrain
    out = {}
    for dtype in rc.export_dtypes:
        summary = export_drafter(drafter_dir, version_dir / dtype, dtype, model_card_info=card, overwrite=True,
                                 allow_unaligned=rc.export_allow_unaligned)
        out[dtype] = {"path": str(version_dir / dtype), "weights_bytes": summary["weights_bytes"],
                      "fp8_alignment_problems": summary.get("fp8_alignment_problems", [])}
    return out


def check_exportable(config: PipelineConfig, drafter_dir: Path) -> None:
    """Refuse (before any work) an FP8 export that export_drafter would refuse after training."""
    rc = config.retrain
    if "fp8" in rc.export_dtypes and not rc.export_allow_unaligned:
        problems = contract.fp8_alignment_problems(json.loads((drafter_dir / "config.json").read_text()))
        if problems:
            raise RetrainError("retrain.export_dtypes includes fp8 but the drafter's widths are not FP8-block "
                               f"aligned: {problems}; set retrain.export_allow_unaligned=true (not servable by "
                               "SGLang's block-FP8 kernels) or drop fp8 from retrain.export_dtypes")


def bootstrap(config: PipelineConfig, sd: StateDir, state: dict, target_path: Path, target_config, log) -> None:
    """First run: install the initial drafter as versions/v0000 and point ``current`` at it."""
    if state["versions"]:
        return
    version = "v0000"
    vdir = sd.version_dir(version)
    if vdir.exists():
        shutil.rmtree(vdir)  # left by a run killed before it committed the bootstrap
    source = initial_drafter(config, target_path, target_config, vdir / "drafter", log)
    check_exportable(config, vdir / "drafter")
    exports = export_all(config, vdir / "drafter", vdir,
                          {"target": str(target_path), "data": f"initial drafter ({source})"})
    info = {"version": version, "cycle": 0, "created": now_iso(), "source": source, "parent": None,
            "drafter": str(vdir / "drafter"), "exports": exports, "tau": None}
    write_json_atomic(vdir / "version.json", info)
    record = {"id": "bootstrap-v0000", "event": "bootstrap", "time": now_iso(), "version": version,
              "source": source}
    state["versions"][version] = {k: info[k] for k in ("cycle", "created", "source", "parent", "tau")}
    state["promoted"] = version
    state["last_record"] = record
    commit(sd, state)
    log(f"[retrain] bootstrap: {version} = {source}; {sd.current} -> {version}")
    tell_engine(config, "bootstrap", version, sd, log)


def install_initial(config: PipelineConfig, log=print) -> str:
    """`scripts/retrain.py --bootstrap`: install the initial drafter as v0000 (running retrain.on_promote, so that
    the engine serves it before the first cycle); nothing to do once a version exists. Returns the current version."""
    sd = StateDir(config.retrain.state_dir)
    with state_lock(sd):
        state = load_state(sd)
        repair(sd, state, log)
        if state["versions"]:
            log(f"[retrain] bootstrap: {sd.root} already has versions; {state['promoted']} is current")
            return state["promoted"]
        target_path = resolve_target(config, log)
        bootstrap(config, sd, state, target_path, load_target_config(target_path, config.target.trust_remote_code), log)
        return state["promoted"]


def tell_engine(config: PipelineConfig, event: str, version: str, sd: StateDir, log) -> None:
    """retrain.on_promote for a version that just became current (after the commit)."""
    notify_engine(config.retrain.on_promote, event, version, sd.version_dir(version),
                  config.retrain.on_promote_timeout, log)


def rollback(config: PipelineConfig, version: str, log=print) -> dict:
    sd = StateDir(config.retrain.state_dir)
    with state_lock(sd):
        state = load_state(sd)
        repair(sd, state, log)
        if version not in state["versions"]:
            raise RetrainError(f"no version {version!r} in {sd.state}; known: {sorted(state['versions'])}")
        if not (sd.version_dir(version) / "drafter" / "config.json").is_file():
            raise RetrainError(f"{sd.version_dir(version)} holds no drafter; cannot roll back to it")
        previous = state["promoted"]
        n = sum(1 for r in read_jsonl(sd.history) if r.get("event") == "rollback") + 1
        record = {"id": f"rollback-{n:04d}", "event": "rollback", "time": now_iso(), "cycle": state["cycle"],
                  "from_version": previous, "to_version": version}
        state["promoted"] = version
        state["last_record"] = record
        commit(sd, state)
        log(f"[retrain] rollback: {sd.current} -> {version} (was {previous}); the next cycle fine-tunes {version}")
    tell_engine(config, "rollback", version, sd, log)
    return record


def notify(config: PipelineConfig, log=print) -> str:
    """Run retrain.on_promote again for the current version (after a failed hook)."""
    sd = StateDir(config.retrain.state_dir)
    version = load_state(sd)["promoted"]
    if version is None:
        raise RetrainError(f"{sd.state}: no version is current yet")
    tell_engine(config, "promote", version, sd, log)
    return version


def status(config: PipelineConfig) -> dict:
    sd = StateDir(config.retrain.state_dir)
    state = load_state(sd)
    return {"state_dir": str(sd.root), "cycle": state["cycle"], "promoted": state["promoted"],
            "current_link": os.readlink(sd.current) if sd.current.is_symlink() else None,
            "versions": state["versions"], "consumed_files": len(state["consumed"]),
            "consumed_requests": len(state["requests"]),
            "in_progress": state["in_progress"], "last_cycles": state["cycles"][-5:]}
