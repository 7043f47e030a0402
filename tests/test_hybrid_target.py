"""A hybrid linear-attention target (Qwen3-Next: gated-delta-net layers + full attention + MoE, built tiny in
code): capture equals HF's hidden states, training runs on it, and speculative decoding returns its recurrent
state to before each rejected block, so the output equals the target's own greedy output."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from configs.schema import DrafterConfig
from drafters.target.capture import HFCapture
from drafters.drafter.config import build_draft_config
from drafters.target.frozen import FrozenTargetHead
from drafters.drafter.model import DFlashDrafter
from drafters.target.recurrent_state import recurrent_layer_types
from drafters.decoding.spec_decode import generate

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512


def tiny_qwen3_next(seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():  # sharper than the random init: greedy continuations that are not one repeated token
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_next()


def test_the_target_is_hybrid(target):
    assert recurrent_layer_types(target.config) == ["linear_attention"]
    assert "full_attention" in target.config.layer_types


def test_capture_equals_hidden_states(target):
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    capture = HFCapture(target, [0, 2, 3])
    try:
        got = capture.capture(ids)
    finally:
        capture.remove()
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([states[1], states[3], states[4]], dim=-1)
    torch.testing.assert_close(got.selected, expected)
    torch.testing.assert_close(got.final_hidden, states[4])


def test_speculative_decoding_restores_the_recurrent_state(target):
    config = build_draft_config(DrafterConfig(num_layers=1, block_size=8, num_target_features=2), target.config, VOCAB - 1)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).eval()
    head = FrozenTargetHead.from_model(target)
    for seed in range(3):
        prompt = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            greedy = target.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        out = generate(drafter, target, prompt, 24, head=head)
        # A random drafter's blocks are rejected at every step: each step returns to the saved state.
        assert out.tau == 1.0 and len(out.acceptance_lengths) == 23
        assert out.output_ids.tolist() == greedy.tolist()
        assert len(set(greedy[0, 12:].tolist())) > 1  # a real continuation, not one repeated token


def test_training_runs_on_the_hybrid_target(target, tmp_path):
    folder = tmp_path / "qwen3-next-tiny"
    target.save_pretrained(folder)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, VOCAB, (16,), generator=g).tolist()  # shared: the offline cache's tree runs it once
    rows = [{"input_ids": prefix + torch.randint(3, VOCAB, (24,), generator=g).tolist(), "loss_mask": [0] * 8 + [1] * 32}
            for _ in range(8)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "data"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for mode in ("online", "offline"):
        result = subprocess.run([
            sys.executable, str(REPO / "train" / "dflash.py"), "--config", str(REPO / "configs" / "testbed.yaml"),
            f"output_dir={tmp_path / mode}", f"target.path={folder}", f"data.dataset={tmp_path / 'data'}",
            f"cache_dir={tmp_path / 'cache'}", f"features.mode={mode}", f"drafter.mask_token_id={VOCAB - 1}",
            "drafter.num_layers=1", "drafter.num_target_features=2", "train.batch_size=2", "train.anchors_per_seq=4",
            "train.max_steps=2", "train.dtype=fp32", "logging.wandb=false",
        ], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / mode / "checkpoints" / "step-000002" / "drafter" / "model.safetensors").exists()
    # Offline: the tree of rows continued the recurrent state from snapshots (a linear-attention cache cannot be
    # cropped), so the shared prefix ran once.
    capture = json.loads((tmp_path / "offline" / "feature_capture.json").read_text())
    assert capture["layout"] == "tree" and capture["target_tokens"] == capture["cached_tokens"] == 16 + 8 * 24


def test_prompt_lookup_restores_the_recurrent_state(target):
    from drafters.decoding.spec_decode import lookup_generate, target_generate

    rolled_back = 0
    for seed in range(3):
        prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(seed))
        truth = target_generate(target, prompt, 64)
        looked = lookup_generate(target, prompt, 64, num_draft=7)  # the output starts to repeat: n-gram drafts
        assert looked.tokens == truth.tokens
        rolled_back += sum(1 for a, d in zip(looked.acceptance_lengths, looked.proposed) if 0 < d and a < d + 1)
    assert rolled_back > 0, "no block was rejected: the rollback path was not exercised"
