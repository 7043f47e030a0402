"""docs/scale.md's numbers, recomputed from the code and the real-scale configs (meta-device models, no weights)."""

from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config

from configs.schema import load_config
from data.feature_cache import feature_bytes_per_token
from drafters.drafter.config import build_draft_config
from drafters.drafter.model import DFlashDrafter

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "scale.md").read_text()
KIMI_K2 = dict(vocab_size=163_840, hidden_size=7_168, intermediate_size=18_432, moe_intermediate_size=2_048,
               num_hidden_layers=61, first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64,
               n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=1_536,
               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def _in_doc(text: str) -> None:
    assert text in DOC, f"docs/scale.md no longer says {text!r}"


@pytest.mark.parametrize("config_file", ["kimi-k2.6.yaml", "deepseek-v3.yaml"])
def test_scale_doc_matches_code_and_configs(config_file):
    config = load_config(REPO / "configs" / config_file)
    target = DeepseekV3Config(**KIMI_K2)
    k, h = config.drafter.num_target_features, target.hidden_size
    bf16, fp8 = feature_bytes_per_token(k, h, "bf16"), feature_bytes_per_token(k, h, "fp8")
    _in_doc(f"**{bf16:,} B/token**")
    _in_doc(f"**{fp8:,} B/token**")
    tokens = config.data.mixture.num_samples * config.data.max_seq_len
    _in_doc(f"**{round(tokens * bf16 / 1e12)} TB**")
    _in_doc(f"**{round(tokens * fp8 / 1e12)} TB**")
    assert config.features.mode == "offline" and config.features.dtype == "fp8"  # the doc's recommendation

    draft = build_draft_config(config.drafter, target, 163_000)
    with torch.device("meta"):
        drafter = DFlashDrafter(draft)
    params = sum(p.numel() for p in drafter.parameters())
    _in_doc(f"**{params:,} parameters")
    assert drafter.target_layer_ids == [1, 15, 30, 44, 58]
    _in_doc(f"**{3.75 * params / 1e9:.1f} GB at N_d = 8**")
    _in_doc(f"**{2 * KIMI_K2['vocab_size'] * h * 2 / 1e9:.1f} GB**")

    gpus = 16  # the configs' launch line: 2 nodes x 8 GPUs
    per_step = config.train.batch_size * gpus * config.train.grad_accum
    _in_doc(f"= {per_step} sequences per optimizer step")
    _in_doc(f"{config.data.mixture.num_samples:,} / {per_step} = {config.data.mixture.num_samples // per_step:,} steps per epoch")
    assert config.train.logits_chunk == 2048 and config.data.max_seq_len == 3072 and config.train.anchors_per_seq == 512
