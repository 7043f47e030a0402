"""Issue 40's probes, black box through the command lines a user runs: a crafted checkpoint runs no code,
a target changed in place is noticed, empty or broken configs never run the default job, a finite blow-up
stops the run, and an export carries no remote-code settings."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file

from drafters.export.contract import ContractError, check_folder
from drafters.target.testbed import save_tiny_target
from train.checkpointing import list_checkpoints, read_trainer_state

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train" / "dflash.py"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    save_tiny_target("llama", root / "target")
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(20, 2000, (48,), generator=g).tolist(), "loss_mask": [0] * 12 + [1] * 36,
             "category": "code"} for _ in range(16)]
    Dataset.from_list(rows).save_to_disk(str(root / "data"))
    return root


def _train_args(workspace: Path, out: Path, *extra: str, target: Path | None = None) -> list[str]:
    return [sys.executable, str(TRAIN), "--config", str(REPO / "configs" / "testbed.yaml"), f"output_dir={out}",
            f"target.path={target or workspace / 'target'}", f"data.dataset={workspace / 'data'}",
            f"cache_dir={workspace / 'cache'}", "drafter.mask_token_id=3", "drafter.num_layers=1",
            "drafter.num_target_features=3", "train.batch_size=2", "train.anchors_per_seq=4", "train.max_steps=4",
            "train.save_every=2", "train.log_every=1", "train.dtype=fp32", "logging.wandb=false", *extra]


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def finished_run(workspace):
    out = workspace / "run"
    result = _run(_train_args(workspace, out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _resumable(finished_run: Path, dst: Path) -> Path:
    shutil.copytree(finished_run, dst)
    shutil.rmtree(list_checkpoints(dst)[-1])
    return dst


# --------------------------------------------------------------------------------------------------
# 1. A crafted checkpoint runs no code
# --------------------------------------------------------------------------------------------------

def test_a_symlinked_state_folder_runs_no_code_even_when_pickles_are_trusted(workspace, finished_run, tmp_path,
                                                                           crafted_pickle):
    out = _resumable(finished_run, tmp_path / "run")
    checkpoint = list_checkpoints(out)[-1]
    marker = tmp_path / "PWNED"
    planted = tmp_path / "elsewhere"  # outside the checkpoint: rglob never looked there
    shutil.move(str(checkpoint / "state"), planted)
    (planted / "optimizer.json").unlink()  # so that the pickle-free loader does not apply
    (planted / "custom_checkpoint_0.pkl").write_bytes(crafted_pickle(marker))
    (checkpoint / "state").symlink_to(planted, target_is_directory=True)

    for trust in ("false", "true"):
        result = _run(_train_args(workspace, out, f"train.trust_checkpoint_pickles={trust}"))
        assert result.returncode == 2, (trust, result.stderr[-3000:])
        assert "symlink" in result.stderr and "state ->" in result.stderr and "Traceback" not in result.stderr
        assert not marker.exists()


def test_a_symlinked_file_is_refused_too(workspace, finished_run, tmp_path):
    out = _resumable(finished_run, tmp_path / "run")
    state = list_checkpoints(out)[-1] / "state"
    real = tmp_path / "scheduler.json"
    shutil.move(str(state / "scheduler.json"), real)
    (state / "scheduler.json").symlink_to(real)
    result = _run(_train_args(workspace, out))
    assert result.returncode == 2 and "state/scheduler.json ->" in result.stderr, result.stderr[-3000:]


def test_a_state_without_its_safetensors_index_is_refused_not_unpickled(workspace, finished_run, tmp_path):
    """optimizer.json missing, no pickle in sight: the only loader left unpickles, so the resume stops."""
    out = _resumable(finished_run, tmp_path / "run")
    (list_checkpoints(out)[-1] / "state" / "optimizer.json").unlink()
    result = _run(_train_args(workspace, out))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "state/optimizer.json is missing" in result.stderr and "trust_checkpoint_pickles" in result.stderr


# --------------------------------------------------------------------------------------------------
# 2. A target changed in place gets new features
# --------------------------------------------------------------------------------------------------

def test_one_tensor_changed_in_place_with_size_and_mtime_restored_triggers_recapture(workspace, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(workspace / "target", target)
    cache = f"cache_dir={tmp_path / 'cache'}"  # a cache of its own: the module's runs captured this content already
    first = _run(_train_args(workspace, tmp_path / "first", cache, target=target))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[features] offline cache" in first.stdout + first.stderr

    again = _run(_train_args(workspace, tmp_path / "again", cache, target=target))  # unchanged: the cache is reused
    assert again.returncode == 0 and "[features] offline cache" not in again.stdout + again.stderr

    weights_file = target / "model.safetensors"
    stat = weights_file.stat()
    weights = load_file(str(weights_file))
    middle = "model.layers.1.mlp.down_proj.weight"  # a layer the drafter reads features after
    weights[middle] = weights[middle] * 1.5
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    os.utime(weights_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_file.stat().st_size == stat.st_size and weights_file.stat().st_mtime_ns == stat.st_mtime_ns

    changed = _run(_train_args(workspace, tmp_path / "changed", cache, target=target))
    logged = changed.stdout + changed.stderr
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert f"{target.resolve()} changed since the last run here" in logged
    assert "[features] offline cache" in logged and "target ran on" in logged
    assert len(list((tmp_path / "cache" / "features").iterdir())) == 2  # the old features stay under their own key


# --------------------------------------------------------------------------------------------------
# 3. Configs fail fast
# --------------------------------------------------------------------------------------------------

BAD_CONFIGS = {
    "empty.yaml": ("", "is empty"),
    "comments.yaml": ("# a config with nothing in it\n\n# yet\n", "is empty"),
    "dashes.yaml": ("---\n", "is empty"),
    "list.yaml": ("- train\n- lr\n", "must hold a mapping"),
    "malformed.yaml": ("train:\n  lr: 1e-4\n  epochs: [1, 2\nlogging:\n  wandb: false\n", "line "),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_training_refuses_an_empty_or_broken_config(name, tmp_path):
    text, expected = BAD_CONFIGS[name]
    path = tmp_path / name
    path.write_text(text)
    result = _run([sys.executable, str(TRAIN), "--config", str(path), f"output_dir={tmp_path / 'out'}",
                   f"cache_dir={tmp_path / 'cache'}"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert str(path) in result.stderr and expected in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()  # nothing started
    if name == "malformed.yaml":
        assert "line 4, column 8" in result.stderr  # where the unclosed list is noticed


@pytest.mark.parametrize("command", [["-m", "scripts.cli", "retrain"], ["-m", "scripts.cli", "eval", "--drafter", "x"],
                                     ["-m", "scripts.cli", "prepare"]])
def test_every_config_command_refuses_empty_and_malformed_configs(command, tmp_path):
    for name in ("empty.yaml", "malformed.yaml"):
        text, expected = BAD_CONFIGS[name]
        path = tmp_path / name
        path.write_text(text)
        result = _run([sys.executable, *command, "--config", str(path)])
        assert result.returncode == 2, (command, name, result.stderr[-3000:])
        assert str(path) in result.stderr and expected in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------------------------------------
# 4. Finite blow-ups stop the run
# --------------------------------------------------------------------------------------------------

def test_a_finite_blow_up_exits_non_zero_and_keeps_the_last_good_checkpoint(workspace, tmp_path):
    """lr=1e6: the loss stays level (the logits saturate) while the weights' norm goes from 17.6 to 1e8."""
    out = tmp_path / "blown"
    result = _run(_train_args(workspace, out, "train.lr=1e6", "train.max_steps=24", "train.save_every=1",
                              "train.keep_last=1", "train.divergence_patience=3"))
    assert result.returncode == 3, result.stderr[-3000:]
    good = out / "checkpoints" / "step-000001"
    assert "training diverged" in result.stderr and "weights' norm" in result.stderr and "Traceback" not in result.stderr
    assert f"the last good checkpoint is {good}" in result.stderr
    # keep_last=1 did not delete it; the ones written while the weights blew up are set aside, not lost
    assert list_checkpoints(out) == [good] and read_trainer_state(good).healthy
    assert (out / "checkpoints" / "diverged" / "step-000003").is_dir()
    first_norm = torch.linalg.vector_norm(torch.stack([t.norm() for t in load_file(str(good / "state" / "model.safetensors")).values()]))
    assert first_norm < 100

    none_saved = _run(_train_args(workspace, tmp_path / "early", "train.lr=1e6", "train.max_steps=24",
                                  "train.save_every=50", "train.divergence_patience=3"))
    assert none_saved.returncode == 3 and "no checkpoint was written" in none_saved.stderr, none_saved.stderr[-3000:]


def test_non_finite_hyperparameters_are_refused_at_load(workspace, tmp_path):
    from configs.schema import ConfigError, load_config

    result = _run(_train_args(workspace, tmp_path / "out", "train.lr=inf"))
    assert result.returncode == 2 and "train.lr" in result.stderr and "finite" in result.stderr, result.stderr[-3000:]
    for value in (".inf", "nan", "-.inf"):  # every float setting, not only the lr
        with pytest.raises(ConfigError, match="finite"):
            load_config(None, [f"train.grad_clip={value}"])


# --------------------------------------------------------------------------------------------------
# 5. Exports are standard
# --------------------------------------------------------------------------------------------------

def test_an_export_never_carries_remote_code_settings(finished_run, tmp_path):
    source = tmp_path / "remote"
    shutil.copytree(list_checkpoints(finished_run)[-1] / "drafter", source)
    cfg = json.loads((source / "config.json").read_text())
    cfg.update(auto_map={"AutoModel": "modeling_dflash.DFlashDraftModel"}, trust_remote_code=True)
    (source / "config.json").write_text(json.dumps(cfg))
    (source / "modeling_dflash.py").write_text("import os\nos.system('touch PWNED')\n")

    export = [sys.executable, "-m", "scripts.cli", "export", str(source), str(tmp_path / "out"), "--dtype", "bf16"]
    refused = _run(export)
    assert refused.returncode == 1 and "auto_map" in refused.stderr and "--allow-remote-code-source" in refused.stderr
    assert not (tmp_path / "out").exists()

    allowed = _run(export + ["--allow-remote-code-source"])
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "auto_map" not in exported and "trust_remote_code" not in exported
    assert not list((tmp_path / "out").glob("*.py"))

    # The contract check rejects an export folder that asks for remote code or ships code.
    exported["auto_map"] = cfg["auto_map"]
    (tmp_path / "out" / "config.json").write_text(json.dumps(exported))
    with pytest.raises(ContractError, match="auto_map"):
        check_folder(tmp_path / "out")
    del exported["auto_map"]
    (tmp_path / "out" / "config.json").write_text(json.dumps(exported))
    check_folder(tmp_path / "out")
    shutil.copy(source / "modeling_dflash.py", tmp_path / "out")
    with pytest.raises(ContractError, match="modeling_dflash.py"):
        check_folder(tmp_path / "out")


def test_a_sidecar_gives_the_content_fingerprint_and_refuses_a_folder_it_does_not_describe(workspace, tmp_path):
    from drafters.target.fingerprint import FingerprintError, target_fingerprint

    target = tmp_path / "target"
    shutil.copytree(workspace / "target", target)
    with pytest.raises(FingerprintError, match="--write"):
        target_fingerprint(target, "sidecar")
    written = _run([sys.executable, "-m", "scripts.cli", "fingerprint", str(target), "--write"])
    assert written.returncode == 0, written.stderr[-3000:]
    assert target_fingerprint(target, "sidecar") == target_fingerprint(target) == written.stdout.split()[-1]
    (target / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(FingerprintError, match="extra.safetensors"):
        target_fingerprint(target, "sidecar")
