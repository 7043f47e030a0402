"""The feature capture job (dflash-pipeline prepare): sharded over ranks, killed, resumed, read by training.

Real processes on a tiny real target (fp32, random weights): one process is SIGKILLed mid-capture, then
torchrun with two ranks finishes the same cache; every stored feature is computed once and equals a
plain per-row capture.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import load_from_disk

from configs.schema import load_config
from data.feature_cache import FeatureCacheReader, cache_complete
from data.trajectory.prefix_tree import PrefixTree
from drafters.target.capture import HFCapture
from drafters.target.loading import load_target_config
from drafters.target.testbed import save_tiny_target
from train.features import config_cache_dir
from train.setup import drafter_layer_ids

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Agent sessions (a shared system prompt, growing turns) as windowed training rows."""
    root = tmp_path_factory.mktemp("capture_job")
    save_tiny_target("llama", root / "target")
    rng = np.random.default_rng(0)
    tree, system = PrefixTree(), rng.integers(20, 2000, 64)
    for s in range(12):
        context = np.concatenate([system, rng.integers(20, 2000, 16)])
        for _ in range(8):
            output = rng.integers(20, 2000, 40)
            tree.add(context, output, session_id=f"s{s}")
            context = np.concatenate([context, output, rng.integers(20, 2000, 30)])
    tree.to_dataset(max_seq_len=2 * MAX_SEQ_LEN).save_to_disk(str(root / "data"))  # rows longer than training's
    return root


def _args(root: Path) -> list[str]:
    return ["--config", str(REPO / "configs" / "testbed.yaml"), f"output_dir={root / 'out'}",
            f"target.path={root / 'target'}", "target.dtype=fp32", f"data.dataset={root / 'data'}",
            f"data.max_seq_len={MAX_SEQ_LEN}", "drafter.mask_token_id=3", "drafter.num_target_features=3",
            "features.mode=offline", "features.shard_tokens=64", f"cache_dir={root / 'cache'}", "logging.wandb=false"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def test_killed_capture_job_resumes_on_two_ranks_and_training_reads_it(workspace):
    args = _args(workspace)
    config = load_config(args[1], args[2:])
    dataset = load_from_disk(str(workspace / "data"))
    layer_ids = drafter_layer_ids(config, workspace / "target", load_target_config(workspace / "target"))
    cache = config_cache_dir(config, dataset, workspace / "target", layer_ids, workspace / "cache")  # training's folder

    job = subprocess.Popen([sys.executable, "-m", "scripts.cli", "prepare", *args], cwd=REPO, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 240
    while not list(cache.glob("shard-*.safetensors")) and job.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.killpg(job.pid, signal.SIGKILL)  # mid-capture: a shard is on disk, the rest is not
    _, stderr = job.communicate()
    assert job.returncode == -signal.SIGKILL, stderr.decode()[-3000:]
    index = json.loads((cache / "index.json").read_text())
    done = [s for s in index["shards"] if (cache / s["file"]).exists()]
    assert not index["complete"] and 0 < len(done) < len(index["shards"]) // 2
    stored_before = sum(s["tokens"] for s in done)

    result = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "scripts.cli", "prepare", *args],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # One manifest on stdout (rank 0's, its capture report under "features"); rank 1 logs its report.
    manifests = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(manifests) == 1 and manifests[0]["rank"] == 0
    reports = [manifests[0]["features"]] + [json.loads(line.split(": ", 1)[1]) for line in result.stderr.splitlines()
                                            if line.startswith("[prepare] rank 1: ")]
    assert [r["rank"] for r in reports] == [0, 1] and {r["cache"] for r in reports} == {str(cache)}
    assert cache_complete(cache) and any(r["complete"] for r in reports)
    unique = reports[0]["cached_tokens"]
    assert unique < reports[0]["row_tokens"]  # the windows' shared prefixes are stored once
    # Nothing stored is computed twice: before the kill + each rank's share = every unique token once.
    assert stored_before + sum(r["tokens_captured"] for r in reports) == unique
    for r in reports:  # besides the stored features, a rank only re-runs one path's KV context (<= max_seq_len)
        assert r["target_tokens"] == r["tokens_captured"] + r["tokens_context"] and r["tokens_context"] <= MAX_SEQ_LEN

    # What training reads (the same folder, checked against its dataset) equals each row captured alone.
    capture = HFCapture(load_tiny_llama(workspace / "target"), layer_ids)
    reader = FeatureCacheReader(cache, dataset, dtype=torch.float32)
    for row in range(len(dataset)):
        ids = dataset[row]["input_ids"][:MAX_SEQ_LEN]
        plain = capture.capture(torch.tensor([ids]))
        selected, final = reader.get_row(row)
        torch.testing.assert_close(selected, plain.selected[0], atol=1e-5, rtol=2**-8)  # one bf16 rounding step
        torch.testing.assert_close(final, plain.final_hidden[0], atol=1e-5, rtol=2**-8)
    capture.remove()


def load_tiny_llama(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
