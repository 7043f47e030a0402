"""Batched generation with the target: left-padded prompts, greedy or seeded sampling, one call per batch.
Regeneration (data.regeneration.regenerate) and the agentic simulator (simulator/) both generate this way."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from drafters.target.attention import decoding_cache
from drafters.target.chat import end_of_turn_ids


def batch_seed(seed: int, ids: Sequence[str]) -> int:
    h = hashlib.sha256(f"{seed}\0".encode() + "\0".join(ids).encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def stop_token_ids(model, tokenizer) -> list[int]:
    """Ids that stop generation: the generation config's eos (of a loaded model, or a model folder), the chat
    template's end of turn (Kimi: <|im_end|>, not its eos [EOS]) and the tokenizer's eos. The one rule of
    regeneration, the eval's decoders and the engine backend, so that all of them stop at the same token."""
    if isinstance(model, (str, Path)):
        from transformers import GenerationConfig

        try:
            generation_config = GenerationConfig.from_pretrained(str(model))
        except OSError:  # no generation_config.json: the tokenizer's ids only
            generation_config = None
    else:
        generation_config = model.generation_config
    ids: list[int] = []
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids += list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids += end_of_turn_ids(tokenizer) if tokenizer is not None else []
    ids = list(dict.fromkeys(int(i) for i in ids))
    if not ids:
        raise ValueError("neither the target's generation_config nor its tokenizer defines an eos token")
    return ids


class BatchGenerator:
    """`generate(prompts, max_new_tokens, keys)`: the new tokens of each prompt (up to max_new_tokens, padding
    after an end of turn included). Sampling is seeded per batch from `seed` and the batch's keys, so a batch
    gives the same tokens whenever it is generated again."""

    def __init__(self, model, tokenizer, temperature: float, seed: int, *, top_p: float = 1.0, top_k: int = 0,
                 buffered_cache: bool = True):
        self.model, self.buffered_cache = model, buffered_cache
        self.eos_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.temperature, self.seed = float(temperature), int(seed)
        self.sampling: dict[str, Any] = (
            {"do_sample": True, "temperature": self.temperature, "top_p": float(top_p), "top_k": int(top_k)}
            if self.temperature > 0 else {"do_sample": False})
        self.seconds = 0.0  # spent in generate()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, keys: Sequence[str]) -> list[list[int]]:
        return self.generate_with_features(prompts, max_new_tokens, keys, tap=None)[0]

    def generate_with_features(self, prompts: list[list[int]], max_new_tokens: int, keys: Sequence[str], tap
                               ) -> tuple[list[list[int]], "GeneratedFeatures | None"]:
        """generate(), and with `tap` (a drafters.target.capture.HFCapture on this model) the target features of
        every prompt and generated token, recorded from the forwards generation runs anyway: the prefill,
        each decode step, and one step more for the last token (generation never feeds it back)."""
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        if self.temperature > 0:
            torch.manual_seed(batch_seed(self.seed, keys))
        started = time.perf_counter()
        features = None
        # generate() caches width + max_new_tokens - 1 positions; the tap's last step feeds the final token back.
        cache = decoding_cache(self.model, attention, width + max_new_tokens) if self.buffered_cache else None
        settings = {"max_new_tokens": max_new_tokens, "eos_token_id": self.eos_ids, "pad_token_id": self.pad_id,
                    **({"past_key_values": cache} if cache is not None else {}), **self.sampling}
        with torch.inference_mode():
            if tap is None:
                sequences = self.model.generate(input_ids=input_ids, attention_mask=attention, **settings)
            else:
                with tap.record_forwards() as forwards:
                    out = self.model.generate(input_ids=input_ids, attention_mask=attention,
                                              return_dict_in_generate=True, **settings)
                    sequences = out.sequences
                    # generate() attends to every generated column (padding after an end of turn too).
                    mask = torch.cat([attention, torch.ones(len(prompts), sequences.shape[1] - width, dtype=attention.dtype)], 1)
                    cache = out.cache if hasattr(out, "cache") else out.past_key_values
                    tap.decode_step(sequences[:, -1:], mask, mask.sum(1, keepdim=True) - 1, cache)
                features = GeneratedFeatures(torch.cat([f.selected for f in forwards], 1),
                                             torch.cat([f.final_hidden for f in forwards], 1), width)
        self.seconds += time.perf_counter() - started
        return sequences[:, width:].tolist(), features


class GeneratedFeatures:
    """Target features over a generated batch's columns: [B, width + generated, ...], prompts left padded."""

    def __init__(self, selected, final_hidden, width: int):
        self.selected, self.final_hidden, self.width = selected, final_hidden, width

    def row(self, b: int, num_prompt_tokens: int, num_generated: int):
        """(selected [T, K*H], final_hidden [T, H]) of row b's prompt and its first num_generated tokens."""
        span = slice(self.width - num_prompt_tokens, self.width + num_generated)
        return self.selected[b, span], self.final_hidden[b, span]

