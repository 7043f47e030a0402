"""The training script end to end on a tiny real target: runs, checkpoints, resumes, distributes."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from training_runs import final_weights, run_quietly
import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file

from configs.schema import load_config
from drafters.drafter.checkpoint import load_drafter
from drafters.target.testbed import save_tiny_target
from train.checkpointing import RUN_CONFIG, list_checkpoints, pickle_files, read_trainer_state

REPO = Path(__file__).resolve().parents[1]
BLOCK = load_config(REPO / "configs" / "testbed.yaml").drafter.block_size  # every run here trains from that config
TRAIN = REPO / "train" / "dflash.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = save_tiny_target("llama", root / "target")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(16):
        ids = torch.randint(20, 2000, (48,), generator=g).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0] * 12 + [1] * 36, "category": "code"})
    Dataset.from_list(rows).save_to_disk(str(root / "data"))
    Dataset.from_list([{**r, "loss_mask": [0] * 48} for r in rows]).save_to_disk(str(root / "no_mask"))
    return root


def _args(workspace: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "testbed.yaml"),
        f"output_dir={out}", f"target.path={workspace / 'target'}", f"data.dataset={workspace / 'data'}",
        "drafter.mask_token_id=3", "drafter.num_layers=1", "drafter.num_target_features=3",
        "train.batch_size=2", "train.anchors_per_seq=4", "train.max_steps=6", "train.save_every=2",
        "train.keep_last=2", "train.log_every=1", "train.dtype=fp32", "logging.wandb=false", *extra,
    ]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], timeout=300) -> subprocess.CompletedProcess:
    return run_quietly(cmd, timeout)


@pytest.fixture(scope="module")
def reference_run(workspace):
    out = workspace / "plain"
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_train_checkpoints_and_loads(reference_run):
    out = reference_run
    checkpoints = list_checkpoints(out)
    assert [p.name for p in checkpoints] == ["step-000004", "step-000006"]  # keep-last-2
    state = read_trainer_state(checkpoints[-1])
    assert state.step == 6 and "sim_tau" in state.metrics and state.metrics["loss"] > 0
    assert 0.0 <= state.metrics["copy_attention_mass"] <= 1.0  # the testbed trains copy heads
    drafter = load_drafter(checkpoints[-1] / "drafter")
    assert drafter.block_size == BLOCK and drafter.mask_token_id == 3
    assert not any(p.name.startswith(".tmp") for p in (out / "checkpoints").iterdir())


def test_sigkill_at_random_step_then_resume_matches_uninterrupted(workspace, reference_run):
    reference = reference_run
    out = workspace / "killed"
    args = [sys.executable, str(TRAIN), *_args(workspace, out, "train.save_every=1", "train.keep_last=10")]
    proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after = random.Random().randint(1, 4)
    deadline = time.time() + 240
    while len(list_checkpoints(out)) < kill_after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len(list_checkpoints(out))
    assert killed_at < 6, "the run finished before it could be killed"
    result = _run(args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr
    assert read_trainer_state(list_checkpoints(out)[-1]).step == 6
    expected, resumed = final_weights(reference), final_weights(out)
    assert expected.keys() == resumed.keys()
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name


@pytest.mark.parametrize("accelerate_config", ["ddp.yaml", "deepspeed_zero2.yaml"])
def test_distributed_two_processes_save_and_resume(workspace, reference_run, accelerate_config):
    # The DeepSpeed config runs the real ZeRO-2 engine (over gloo on a CPU), which writes its state with pickle.
    deepspeed = accelerate_config.startswith("deepspeed")
    out = workspace / accelerate_config.removesuffix(".yaml")
    launch = [str(ACCELERATE), "launch", "--config_file", str(REPO / "configs" / "accelerate" / accelerate_config), str(TRAIN)]
    if not deepspeed:
        # Several processes only read the offline feature cache (the single-process reference run captured this
        # one): without it they stop at once, naming the capture job, instead of waiting in a barrier.
        refused = _run([*launch, *_args(workspace, out, f"cache_dir={workspace / 'no-cache'}")], timeout=600)
        assert refused.returncode != 0 and "is not complete" in refused.stderr, refused.stderr[-3000:]
        assert "-m scripts.cli prepare" in refused.stderr and not list_checkpoints(out)
    cmd = [*launch, *_args(workspace, out, "train.max_steps=2", "train.save_every=1")]
    result = _run(cmd, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    checkpoint = list_checkpoints(out)[-1]
    assert read_trainer_state(checkpoint).step == 2
    assert (checkpoint / "drafter" / "model.safetensors").exists()
    load_drafter(checkpoint / "drafter")
    state_files = {p.name for p in (checkpoint / "state").iterdir()}
    assert {"rng-0.json", "rng-1.json", "scheduler.json"} <= state_files
    assert bool(pickle_files(checkpoint)) == deepspeed and ("optimizer.json" in state_files) != deepspeed
    shutil.rmtree(checkpoint)  # both processes resume from step 1
    if deepspeed:
        refused = _run(cmd, timeout=600)
        assert refused.returncode != 0 and "train.trust_checkpoint_pickles=true" in refused.stderr
        cmd.append("train.trust_checkpoint_pickles=true")
    result = _run(cmd, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stdout + result.stderr
    assert read_trainer_state(list_checkpoints(out)[-1]).step == 2


def test_dataset_without_loss_mask_fails_before_training(workspace):
    out = workspace / "no_mask_run"
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out, f"data.dataset={workspace / 'no_mask'}")])
    assert result.returncode == 2
    assert "no loss-mask tokens" in result.stderr and "no_mask" in result.stderr
    assert not out.exists() or not list_checkpoints(out)


def test_category_repeats_visit_a_category_more_often_and_unknown_ones_are_refused(workspace):
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(20, 2000, (40,), generator=g).tolist(), "loss_mask": [0] * 8 + [1] * 32,
             "category": "chat" if i < 2 else "code"} for i in range(8)]
    Dataset.from_list(rows).save_to_disk(str(workspace / "two_categories"))
    data = f"data.dataset={workspace / 'two_categories'}"
    one_epoch = ("train.max_steps=", "train.epochs=1", "train.save_every=100")

    out = workspace / "chat_thrice"
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out, data, *one_epoch,
                                                      "train.category_repeats={chat: 3}")])
    assert result.returncode == 0, result.stderr[-3000:]
    # 6 code rows once and 2 chat rows three times: 12 rows, 6 batches of 2 (4 without the repeats)
    assert "an epoch visits 12 rows: 8 sequences" in result.stdout
    assert read_trainer_state(list_checkpoints(out)[-1]).step == 6

    refused = workspace / "prose_repeats"
    result = _run([sys.executable, str(TRAIN), *_args(workspace, refused, data, "train.category_repeats={prose: 2}")])
    assert result.returncode == 2
    assert "train.category_repeats names ['prose']" in result.stderr and "['chat', 'code']" in result.stderr
    assert not refused.exists() or not list_checkpoints(refused)


def test_epoch_order_repeats_rows_and_is_the_plain_order_without_repeats():
    from train.batches import epoch_batches, epoch_rows

    dataset = Dataset.from_list([{"input_ids": [1, 2], "loss_mask": [1, 1], "category": c}
                                 for c in ["code", "chat", "prose", "chat", "code"]])
    rows = epoch_rows(dataset, "five", {"chat": 2})
    batches = epoch_batches(rows, 3, seed=0, epoch=1)
    visited = sorted(r for b in batches for r in b)
    assert visited == [0, 1, 1, 2, 3, 3, 4] and [len(b) for b in batches] == [3, 3, 1]
    plain = epoch_batches(epoch_rows(dataset, "five", {}), 2, seed=0, epoch=1)
    assert [r for b in plain for r in b] == torch.randperm(5, generator=torch.Generator().manual_seed(1)).tolist()


def test_drafter_that_does_not_fit_the_target_is_refused(workspace):
    result = _run([sys.executable, str(TRAIN), *_args(workspace, workspace / "bad", "drafter.target_layer_ids=[1,9]")])
    assert result.returncode == 2
    assert "target_layer_ids [9] out of range for a target with num_hidden_layers 8" in result.stderr


def test_offline_feature_cache_trains_like_online(workspace, reference_run):
    out = workspace / "offline"
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out, "features.mode=offline",
                                                      f"cache_dir={workspace / 'cache'}")])
    assert result.returncode == 0, result.stderr[-3000:]
    caches = list((workspace / "cache" / "features").iterdir())
    assert len(caches) == 1 and (caches[0] / "index.json").exists()
    online = read_trainer_state(list_checkpoints(reference_run)[-1]).metrics
    offline = read_trainer_state(list_checkpoints(out)[-1]).metrics
    assert offline["loss"] == pytest.approx(online["loss"], rel=0.02)
    for name, tensor in final_weights(reference_run).items():
        assert torch.allclose(tensor.float(), final_weights(out)[name].float(), atol=2e-2), name
    # The target's greedy choices (ce_target labels) were kept beside the cache: a second run on it reads them
    # instead of projecting every cached position again, and trains bit-identically.
    assert (caches[0] / "target_choices.safetensors").exists()
    again = _run([sys.executable, str(TRAIN), *_args(workspace, workspace / "offline-again", "features.mode=offline",
                                                     f"cache_dir={workspace / 'cache'}")])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "greedy choices of every row read from" in again.stdout
    for name, tensor in final_weights(out).items():
        assert torch.equal(tensor, final_weights(workspace / "offline-again")[name]), name


def test_loss_mask_anchors_with_weighted_slots_train_deterministically(workspace):
    # The testbed config (so every other run here) anchors anywhere along the target's greedy path and
    # samples slots; this is the paper's plain recipe: anchors in the loss mask, every slot weighted.
    extra = ("train.anchor_scope=loss_mask", "train.sample_slots=false", "train.max_steps=3")
    runs = [workspace / "plain-a", workspace / "plain-b"]
    for out in runs:
        result = _run([sys.executable, str(TRAIN), *_args(workspace, out, *extra)])
        assert result.returncode == 0, result.stderr[-3000:]
    state = read_trainer_state(list_checkpoints(runs[0])[-1])
    assert state.step == 3 and state.metrics["loss"] > 0
    # Every slot weighted (no slot sampling): the simulated tau is bounded by slot 1's accuracy, 1 + acc1 <= tau
    # <= 1 + (B-1) acc1 (a block accepts slot k only after slot 1).
    tau, acc1 = state.metrics["sim_tau"], state.metrics["slot1_acc"]
    assert 1.0 + acc1 - 1e-9 <= tau <= 1.0 + (BLOCK - 1) * acc1 + 1e-9, state.metrics
    a, b = final_weights(runs[0]), final_weights(runs[1])
    assert all(torch.equal(a[name], b[name]) for name in a)
    same = {k: v for k, v in read_trainer_state(list_checkpoints(runs[1])[-1]).metrics.items() if k != "block_tokens_per_s"}
    assert same == {k: v for k, v in state.metrics.items() if k != "block_tokens_per_s"}  # the metrics too


def test_stage_two_finetunes_from_a_stage_one_output_dir(workspace, reference_run):
    from data.trajectory.reader import write_trajectories

    g = torch.Generator().manual_seed(1)
    system = torch.randint(20, 2000, (24,), generator=g).tolist()
    records = []
    for s in range(4):
        context = system + torch.randint(20, 2000, (8,), generator=g).tolist()
        for turn in range(3):
            output = torch.randint(20, 2000, (10,), generator=g).tolist()
            records.append({"session_id": f"s{s}", "request_id": f"s{s}-r{turn}", "input_ids": list(context),
                            "output_ids": output, "timestamp": 1_700_000_000.0 + turn})
            context += output + torch.randint(20, 2000, (5,), generator=g).tolist()
    log = workspace / "logs" / "traffic.jsonl"
    log.parent.mkdir(exist_ok=True)
    write_trajectories(records, log)
    with open(log, "a") as f:
        f.write('{"session_id": "s9", "request_id": "bad", "input_ids": [1, 2], "output_ids": "oops"}\n')
    out = workspace / "stage2"
    stage2_args = ["--config", str(REPO / "configs" / "testbed-finetune.yaml"),
                   f"output_dir={out}", f"target.path={workspace / 'target'}", f"data.trajectories=[{log}]",
                   f"train.init_from={reference_run}", f"cache_dir={workspace / 'cache'}", "train.max_steps=2",
                   "train.batch_size=2", "train.anchors_per_seq=4", "train.dtype=fp32", "logging.wandb=false"]
    # The prepare stage owns the data: the prefix-tree dataset with its manifest, then the feature cache.
    prepared = _run([sys.executable, "-m", "scripts.cli", "prepare", *stage2_args])
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    manifest = json.loads(prepared.stdout.strip().splitlines()[-1])
    assert manifest["kind"] == "dflash-prepared-trajectories"
    ingest = manifest["ingest"]
    assert (ingest["read"], ingest["accepted"], ingest["quarantined"]) == (13, 12, 1)
    assert "traffic.jsonl:13" in Path(ingest["quarantine_path"]).read_text()  # the manifest names the kept quarantine
    result = _run([sys.executable, str(TRAIN), *stage2_args])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"init_from {reference_run}" in result.stdout + result.stderr
    assert not (out / "feature_capture.json").exists()  # training only read what prepare made
    stage1 = load_drafter(list_checkpoints(reference_run)[-1] / "drafter")
    stage2 = load_drafter(list_checkpoints(out)[-1] / "drafter")
    # the stage-1 architecture, target layers and mask token carry over (the YAML's drafter section is unused)
    assert stage2.config.num_hidden_layers == 1 and stage2.target_layer_ids == stage1.target_layer_ids
    assert stage2.mask_token_id == 3
    assert json.loads((out / "trajectory_summary.json").read_text())["ingest"]["quarantined"] == 1
    assert "output_ids" in (out / "quarantine.jsonl").read_text()
    # Stage 2's features come from the prefix-tree cache: the target ran once per unique token of the
    # training rows (the shared system prompt and each session's earlier turns once), not once per row.
    from data.trajectory.prefix_tree import PrefixTree

    tree = PrefixTree()
    for r in records:
        tree.add(r["input_ids"], r["output_ids"])
    stats = tree.stats()
    capture = manifest["features"]
    assert capture["layout"] == "tree" and capture["complete"]
    assert capture["target_tokens"] == capture["cached_tokens"] == stats.unique_tokens
    assert capture["row_tokens"] == stats.path_tokens > stats.unique_tokens  # every row captured alone: 288 vs 216

    # More traffic later: the grown set's cache copies what the first one holds; the target runs on the new tokens.
    more = []
    for s in range(4, 6):
        context = system + torch.randint(20, 2000, (8,), generator=g).tolist()
        output = torch.randint(20, 2000, (10,), generator=g).tolist()
        more.append({"session_id": f"s{s}", "request_id": f"s{s}-r0", "input_ids": list(context),
                     "output_ids": output, "timestamp": 1_700_000_100.0})
    write_trajectories(more, workspace / "logs" / "more.jsonl")
    grown_args = [a.replace(f"[{log}]", f"[{log}, {workspace / 'logs' / 'more.jsonl'}]") for a in stage2_args]
    grown = _run([sys.executable, "-m", "scripts.cli", "prepare", *grown_args])
    assert grown.returncode == 0, grown.stderr[-3000:]
    for r in more:
        tree.add(r["input_ids"], r["output_ids"])
    grown_capture = json.loads(grown.stdout.strip().splitlines()[-1])["features"]
    # other tests' tree caches of this tiny target may be listed too; only the first set's cache holds these tokens
    assert capture["cache"] in grown_capture["reused_from"] and grown_capture["tokens_reused"] == stats.unique_tokens
    assert grown_capture["tokens_captured"] == tree.stats().unique_tokens - stats.unique_tokens
    # besides the new tokens, the target re-ran only the shared system prompt, as the new sessions' KV context
    assert grown_capture["target_tokens"] == grown_capture["tokens_captured"] + len(system) == grown_capture[
        "tokens_captured"] + grown_capture["tokens_context"]


def test_reduced_head_with_target_labels_keeps_learning_curve_snapshots(workspace):
    out = workspace / "reduced_head"
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out, "train.loss=ce_target", "train.head_vocab=64",
                                                      "train.snapshot_every=3")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training head: 64 of" in result.stdout
    # a random target's choices are not the data's tokens: the head follows what the target emits
    assert read_trainer_state(list_checkpoints(out)[-1]).metrics["loss"] > 0
    snapshots = sorted((out / "snapshots").iterdir())
    assert [p.name for p in snapshots] == ["step-000003", "step-000006"]
    states = [json.loads((p / "trainer_state.json").read_text()) for p in snapshots]
    assert [s["step"] for s in states] == [3, 6]
    assert 0 < states[0]["elapsed_seconds"] < states[1]["elapsed_seconds"]
    # the serving drafter is the same architecture whatever head trained it
    served = load_drafter(snapshots[-1])
    assert served.block_size == BLOCK and torch.equal(
        load_file(str(snapshots[-1] / "model.safetensors"))["fc.weight"],
        final_weights(out)["fc.weight"])


def _resumable_copy(run: Path, dst: Path) -> Path:
    """A finished run without its newest checkpoint: a rerun resumes it from the one before."""
    shutil.copytree(run, dst)
    shutil.rmtree(list_checkpoints(dst)[-1])
    return dst


def test_resume_refuses_a_planted_pickle_and_stays_bit_identical(workspace, reference_run, tmp_path, crafted_pickle):
    assert not any(pickle_files(c) for c in list_checkpoints(reference_run))  # what training writes
    out = _resumable_copy(reference_run, tmp_path / "run")
    marker = tmp_path / "unpickled"
    state = list_checkpoints(out)[-1] / "state"
    (state / "custom_checkpoint_0.pkl").write_bytes(crafted_pickle(marker))  # accelerate's old scheduler file
    (state / "notes").write_bytes(crafted_pickle(marker))  # found by content, whatever its name
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out)])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "state/custom_checkpoint_0.pkl" in result.stderr and "state/notes" in result.stderr
    assert "trust_checkpoint_pickles" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists() and read_trainer_state(list_checkpoints(out)[-1]).step == 4

    # A trusted folder resumes (a changed keep_last is accepted and logged); the pickle-free state is all
    # a resume reads, so the planted files are still never unpickled, and the weights are bit-identical.
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out, "train.trust_checkpoint_pickles=true",
                                                      "train.keep_last=3")])
    assert result.returncode == 0, result.stderr[-3000:]
    logged = result.stdout + result.stderr
    assert "resumed from" in logged and "train.keep_last: 2 -> 3" in logged and "trusted" in logged
    assert not marker.exists()
    expected, resumed = final_weights(reference_run), final_weights(out)
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)


def test_a_checkpoint_saved_under_the_old_keys_and_spellings_resumes(workspace, reference_run, tmp_path):
    """Settings saved before keys moved (train.precision, features.cache_dtype, eval.agentic_log, retrain.incoming)
    and before dtypes had one spelling (float32) still mean the same run: it resumes, bit-identical; the same
    keys on the command line are refused with the new key named."""
    out = _resumable_copy(reference_run, tmp_path / "run")
    for checkpoint in list_checkpoints(out):
        saved = json.loads((checkpoint / RUN_CONFIG).read_text())
        saved["train"]["precision"] = {"fp32": "float32"}.get(saved["train"].pop("dtype"), "auto")
        saved["features"]["cache_dtype"] = saved["features"].pop("dtype")
        saved["eval"]["agentic_log"] = saved["eval"].pop("trajectories")
        saved["retrain"]["incoming"] = saved["retrain"].pop("trajectories")
        saved["eval"]["dtype"] = "float32"
        (checkpoint / RUN_CONFIG).write_text(json.dumps(saved))
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr and "differ" not in result.stderr
    expected, resumed = final_weights(reference_run), final_weights(out)
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)
    old = _run([sys.executable, str(TRAIN), *_args(workspace, tmp_path / "new", "train.precision=fp32",
                                                   "target.dtype=float32")])
    assert old.returncode == 2 and "'train.precision' is now 'train.dtype'" in old.stderr, old.stderr[-3000:]
    assert "'target.dtype': 'float32' is spelled 'fp32'" in old.stderr


def test_resume_refuses_changed_settings_and_names_them(workspace, reference_run, tmp_path):
    out = _resumable_copy(reference_run, tmp_path / "run")
    lr = _run([sys.executable, str(TRAIN), *_args(workspace, out, "train.lr=1e-3")])
    assert lr.returncode == 2 and "train.lr: 0.0006 -> 0.001" in lr.stderr, lr.stderr[-3000:]
    assert "resume_allow_config_change" in lr.stderr
    layers = _run([sys.executable, str(TRAIN), *_args(workspace, out, "drafter.num_layers=2")])
    assert layers.returncode == 2 and "drafter.num_layers: 1 -> 2" in layers.stderr, layers.stderr[-3000:]
    assert "Traceback" not in layers.stderr and "state_dict" not in layers.stderr
    layers = _run([sys.executable, str(TRAIN), *_args(workspace, out, "drafter.num_layers=2",
                                                      "train.resume_allow_config_change=true")])
    assert layers.returncode == 2 and "architecture cannot change" in layers.stderr, layers.stderr[-3000:]
    assert read_trainer_state(list_checkpoints(out)[-1]).step == 4

    # Accepted explicitly, the new lr applies from the resumed step on (the weights are not the old run's).
    allowed = _run([sys.executable, str(TRAIN), *_args(workspace, out, "train.lr=1e-3",
                                                       "train.resume_allow_config_change=true")])
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "train.lr: 0.0006 -> 0.001" in allowed.stdout + allowed.stderr
    expected, resumed = final_weights(reference_run), final_weights(out)
    assert not all(torch.equal(expected[k], resumed[k]) for k in expected)


def _all_finite(tensors: dict) -> bool:
    return all(torch.isfinite(t.float()).all() for t in tensors.values())


def test_diverging_run_stops_and_its_newest_checkpoint_is_finite(workspace):
    out = workspace / "diverged"
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out, "train.lr=1e30", "train.save_every=1",
                                                      "train.keep_last=10", "train.max_nonfinite_steps=2")])
    assert result.returncode == 3, (result.returncode, result.stderr[-3000:])
    assert "training diverged" in result.stderr and "Traceback" not in result.stderr
    newest = list_checkpoints(out)[-1]
    assert str(newest) in result.stderr and read_trainer_state(newest).step < 6
    assert _all_finite(load_file(str(newest / "state" / "model.safetensors")))
    assert _all_finite(load_file(str(newest / "drafter" / "model.safetensors")))


def test_non_finite_weights_stop_the_run(workspace, reference_run, tmp_path):
    broken = tmp_path / "nan-drafter"
    shutil.copytree(list_checkpoints(reference_run)[-1] / "drafter", broken)
    weights = load_file(str(broken / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name][0] = float("nan")
    save_file(weights, str(broken / "model.safetensors"))
    out = tmp_path / "run"
    result = _run([sys.executable, str(TRAIN), *_args(workspace, out, "train.stage=finetune",
                                                      f"train.init_from={broken}")])
    assert result.returncode == 3, (result.returncode, result.stderr[-3000:])
    assert "non-finite weights" in result.stderr and "no checkpoint was written" in result.stderr
    assert not list_checkpoints(out)


def test_output_dir_that_is_a_file_is_refused_before_any_work(workspace, tmp_path):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    # target.path names nothing: had the target been touched first, that would be the error.
    result = _run([sys.executable, str(TRAIN), *_args(workspace, a_file, f"target.path={tmp_path / 'nowhere'}")])
    assert result.returncode == 2 and f"output_dir {a_file} exists and is not a folder" in result.stderr
