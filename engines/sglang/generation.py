"""Regeneration through SGLang's offline engine (`sglang.Engine`), token ids in and token ids out.

Written against SGLang's public API (python/sglang/srt/entrypoints/engine.py, managers/io_struct.py,
sampling/sampling_params.py; read at sgl-project/sglang@001067ff): `Engine(**ServerArgs fields)` and
`Engine.generate(input_ids=[[...], ...], sampling_params={...})`, which returns one dict per prompt:
`{"output_ids": [generated ids only], "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort",
"matched": id or str}, "prompt_tokens": n, "completion_tokens": n, ...}}` ("text" too unless the engine
skips its tokenizer, as here).

sglang is GPU-only and an optional extra: it is imported inside `SGLangGenerator` only. The request
building and the output parsing are plain functions, tested here without it.

Features are not taken from SGLang: its Engine returns the last layer's hidden states only (intermediate
layers have no public API; sgl-project/sglang#8214 was closed), so `target.capture_backend` says where
they come from.
"""

from __future__ import annotations

from pathlib import Path

from configs.schema import TargetConfig
from engines.settings import sglang_kwargs


class EngineOutputError(RuntimeError):
    """An engine answer this pipeline cannot use as a response; the message names the request."""


def sampling_params(max_new_tokens: int, temperature: float, top_p: float, top_k: int, stop_token_ids: list[int],
                    seed: int) -> dict:
    """SGLang's sampling_params for a regeneration request: greedy at temperature 0 (SGLang reads a
    temperature under 1e-6 as top_k 1), stopping on the target's end-of-turn ids, which stay in the output."""
    params = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
              "stop_token_ids": sorted(int(t) for t in stop_token_ids), "skip_special_tokens": False,
              "no_stop_trim": True}
    if temperature > 0:
        params.update(top_p=float(top_p), top_k=int(top_k) if top_k > 0 else -1, sampling_seed=int(seed))
    return params


def response_ids(output: dict, index: int, stop_token_ids: set[int]) -> list[int]:
    """The generated ids of one answer, ending with the stop token when the engine stopped on one (SGLang
    versions differ in whether output_ids keep it). An aborted request or a malformed answer is an error."""
    if not isinstance(output, dict) or not isinstance(output.get("output_ids"), list):
        raise EngineOutputError(f"SGLang answer #{index}: no output_ids list ({str(output)[:200]})")
    ids = output["output_ids"]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise EngineOutputError(f"SGLang answer #{index}: output_ids are not token ids ({str(ids)[:200]})")
    finish = (output.get("meta_info") or {}).get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        raise EngineOutputError(f"SGLang answer #{index} was aborted ({finish.get('message', finish)})")
    matched = finish.get("matched") if isinstance(finish, dict) else None
    if kind == "stop" and isinstance(matched, int) and matched in stop_token_ids and (not ids or ids[-1] != matched):
        ids = [*ids, matched]
    return list(ids)


class SGLangGenerator:
    """generate(prompt id lists) -> response id lists, through one in-process `sglang.Engine`."""

    def __init__(self, target: TargetConfig, target_path: str | Path, *, max_model_len: int, max_new_tokens: int,
                 temperature: float, top_p: float, top_k: int, seed: int, stop_token_ids: list[int]):
        try:
            import sglang
        except ImportError as err:
            raise ValueError(f"target.backend: sglang needs SGLang installed ({err}); it runs on GPUs only") from None
        self.engine = sglang.Engine(**sglang_kwargs(target, target_path, max_model_len=max_model_len, seed=seed))
        self.params = sampling_params(max_new_tokens, temperature, top_p, top_k, stop_token_ids, seed)
        self.stop = set(stop_token_ids)

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        outputs = self.engine.generate(input_ids=[list(map(int, p)) for p in prompts], sampling_params=self.params)
        if isinstance(outputs, dict):
            outputs = [outputs]
        if len(outputs) != len(prompts):
            raise EngineOutputError(f"SGLang answered {len(outputs)} of {len(prompts)} prompts")
        return [response_ids(out, i, self.stop) for i, out in enumerate(outputs)]

    def close(self) -> None:
        self.engine.shutdown()
