"""Gradient accumulation under DDP and DeepSpeed ZeRO-2 (2 processes, gloo, CPU) against one process:
the same sequences per optimizer step, the same steps per epoch, the same weights."""

import subprocess
import sys
from pathlib import Path

import pytest
from training_runs import final_weights, run_quietly
import torch
from datasets import Dataset
from safetensors.torch import load_file

from drafters.target.testbed import save_tiny_target
from train.checkpointing import list_checkpoints, pickle_files, read_trainer_state

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train" / "dflash.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
ROWS, BATCH, EPOCHS = 16, 2, 2
SEQUENCES_PER_STEP = 8  # one process x 2 x grad_accum 4 == two processes x 2 x grad_accum 2
STEPS_PER_EPOCH = ROWS // SEQUENCES_PER_STEP


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("grad_accum")
    save_tiny_target("llama", root / "target")
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(20, 2000, (40,), generator=g).tolist(), "loss_mask": [0] * 8 + [1] * 32}
            for _ in range(ROWS)]
    Dataset.from_list(rows).save_to_disk(str(root / "data"))
    return root


def _args(workspace: Path, out: Path, grad_accum: int) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "testbed.yaml"),
        f"output_dir={out}", f"target.path={workspace / 'target'}", f"data.dataset={workspace / 'data'}",
        "drafter.mask_token_id=3", "drafter.num_layers=1", "drafter.num_target_features=2",
        f"train.batch_size={BATCH}", f"train.grad_accum={grad_accum}", f"train.epochs={EPOCHS}", "train.max_steps=null",
        "train.anchors_per_seq=4", "train.lr=5e-3", "train.warmup_ratio=0", "train.save_every=100",
        "train.log_every=1", "train.dtype=fp32", "train.trust_checkpoint_pickles=true", "logging.wandb=false",
    ]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    result = run_quietly(cmd, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def single_process(workspace):
    out = workspace / "single"
    _run([sys.executable, str(TRAIN), *_args(workspace, out, grad_accum=4)])
    return out


@pytest.mark.parametrize("accelerate_config", ["ddp.yaml", "deepspeed_zero2.yaml"])
def test_two_processes_accumulate_like_one(workspace, single_process, accelerate_config):
    out = workspace / accelerate_config.removesuffix(".yaml")
    result = _run([str(ACCELERATE), "launch", "--config_file", str(REPO / "configs" / "accelerate" / accelerate_config),
                   str(TRAIN), *_args(workspace, out, grad_accum=2)])
    reference, distributed = read_trainer_state(list_checkpoints(single_process)[-1]), read_trainer_state(list_checkpoints(out)[-1])
    # Steps per epoch: 16 sequences / 8 per step; the run ends in its second epoch after 2 x 2 steps.
    assert reference.step == distributed.step == STEPS_PER_EPOCH * EPOCHS
    assert reference.epoch == distributed.epoch == EPOCHS - 1
    assert reference.metrics["sequences_per_step"] == distributed.metrics["sequences_per_step"] == SEQUENCES_PER_STEP
    if accelerate_config == "deepspeed_zero2.yaml":  # the real ZeRO-2 engine ran (it writes its own pickled state)
        assert "zero_pp_rank_1" in " ".join(p.name for p in pickle_files(list_checkpoints(out)[-1]))
    else:
        assert not pickle_files(list_checkpoints(out)[-1])
    # Same sequences and anchors per step, gradients averaged alike: the same weights, to bf16 rounding.
    expected, got = final_weights(single_process), final_weights(out)
    initial = load_file(str(_initial_drafter(workspace) / "model.safetensors"))
    moved = max(float((expected[k].float() - initial[k].float()).abs().max()) for k in expected)
    assert moved > 1e-2, "training barely moved the weights: the comparison would prove nothing"
    for name in expected:
        torch.testing.assert_close(got[name].float(), expected[name].float(), rtol=2 ** -7, atol=1e-4, msg=name)


def _initial_drafter(workspace: Path) -> Path:
    """The drafter every run starts from (same seed): a zero-step run's serving copy."""
    out = workspace / "initial"
    if not list_checkpoints(out):
        _run([sys.executable, str(TRAIN), *_args(workspace, out, grad_accum=4), "train.lr=1e-12", "train.max_steps=1"])
    return list_checkpoints(out)[-1] / "drafter"
