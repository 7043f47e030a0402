"""Target-feature capture: the K chosen layer outputs and the final normed hidden state.

Layer id i is the OUTPUT of 0-based decoder layer i, i.e. HF hidden_states[i + 1]. For the last layer
(i = L - 1) HF's hidden_states[L] is the final-norm output, so that id returns the normed state too.

`HFCapture` runs the target's decoder (never its lm_head) with forward hooks that keep only the needed
layers' outputs, instead of output_hidden_states=True which holds all L + 1 states. A serving-engine
backend (SGLang) would implement the same `FeatureCapture` interface; `make_capture` imports it lazily.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch
from torch import nn


class Captured(NamedTuple):
    selected: torch.Tensor      # [B, T, K*H] the chosen layers, concatenated in layer_ids order
    final_hidden: torch.Tensor  # [B, T, H] output of the final norm (lm_head(final_hidden) = logits)


class FeatureCapture(ABC):
    layer_ids: list[int]

    @abstractmethod
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> Captured:
        ...


class _StopForward(Exception):
    pass


def decoder_of(model: nn.Module) -> nn.Module:
    """The bare decoder (embeddings, layers, norm) of an HF causal LM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise TypeError(f"{type(model).__name__}: cannot find decoder layers and final norm")
    return decoder


class HFCapture(FeatureCapture):
    """Forward hooks on an in-process HF target (optionally dispatched with device_map)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], output_device: torch.device | str | None = None):
        self.model = model
        self.decoder = decoder_of(model)
        self.num_layers = len(self.decoder.layers)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a target with {self.num_layers} layers")
        self.layer_ids = list(layer_ids)
        if output_device is None:
            output_device = self.decoder.get_input_embeddings().weight.device
        self.output_device = torch.device(output_device)
        self._store: dict = {}
        self._recording = False
        self._stop_after: int | None = None
        self._forwards: list[Captured] | None = None  # set inside record_forwards()
        # Optional lookup: a row's token ids -> its Captured [T, ...] computed earlier (regeneration keeps
        # them), or None. capture() then runs the target only on the rows it does not know.
        self.known_features = None
        self.tokens_reused = self.computed_tokens = 0
        self.forwarded_tokens = 0  # positions run through the target (padding included): what capture cost
        hooked = {i for i in self.layer_ids if i < self.num_layers - 1}
        self._handles = [self.decoder.layers[i].register_forward_hook(self._layer_hook(i)) for i in sorted(hooked)]
        self._handles.append(self.decoder.norm.register_forward_hook(self._norm_hook))
        # transformers >= 5.24 renamed the decoder's past_key_values argument to cache.
        params = inspect.signature(self.decoder.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _keep(self, key, output):
        if self._recording:
            hidden = output[0] if isinstance(output, tuple) else output
            self._store[key] = hidden.to(self.output_device)

    def _layer_hook(self, i: int):
        def hook(module, args, output):
            self._keep(i, output)
            if self._recording and self._stop_after == i:
                raise _StopForward
        return hook

    def _norm_hook(self, module, args, output):
        self._keep("final", output)
        if self._forwards is not None:  # the norm runs last: one whole forward is in the store
            self._forwards.append(self._collect(self._store, with_final=True))
            self._store = {}

    def _collect(self, store: dict, with_final: bool) -> Captured:
        last = self.num_layers - 1
        final = store.get("final")
        selected = torch.cat([final if i == last else store[i] for i in self.layer_ids], dim=-1)
        return Captured(selected, final if with_final else None)

    @contextmanager
    def record_forwards(self) -> Iterator[list[Captured]]:
        """Inside the block, every forward of the model appends its Captured to the yielded list: the
        prefill and each decode step of `model.generate`, so generated tokens need no second pass."""
        self._forwards, self._store, self._recording = [], {}, True
        try:
            yield self._forwards
        finally:
            self._forwards, self._store, self._recording = None, {}, False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @torch.no_grad()
    def capture(self, input_ids, attention_mask=None, *, past_key_values=None, position_ids=None,
                with_final: bool = True) -> Captured:
        """Run the target on input_ids; a given DynamicCache is extended in place (continue a prefix).

        with_final=False skips the final hidden state and, with no cache, stops the forward after the
        last needed layer (final_hidden is then None). Outputs are plain (not inference-mode) tensors,
        so they can feed a trained module.
        """
        if self.known_features is not None and past_key_values is None and position_ids is None:
            return self._capture_reusing(input_ids, attention_mask, with_final)
        return self._run(input_ids, attention_mask, past_key_values, position_ids, with_final)

    def _run(self, input_ids, attention_mask, past_key_values, position_ids, with_final: bool) -> Captured:
        last = self.num_layers - 1
        stop_early = not with_final and past_key_values is None and last not in self.layer_ids
        self._stop_after = max(self.layer_ids) if stop_early else None
        self._store, self._recording = {}, True
        self.forwarded_tokens += int(input_ids.numel())
        try:
            self.decoder(
                input_ids=input_ids.to(self.decoder.get_input_embeddings().weight.device),
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=past_key_values is not None,
                **{self.cache_kwarg: past_key_values},
            )
        except _StopForward:
            pass
        finally:
            self._recording = False
        store, self._store = self._store, {}
        return self._collect(store, with_final)

    def _capture_reusing(self, input_ids, attention_mask, with_final: bool) -> Captured:
        """Right-padded rows: known rows from the lookup, the rest through the target in one batch."""
        lengths = [input_ids.shape[1]] * len(input_ids) if attention_mask is None else attention_mask.sum(1).tolist()
        rows = [input_ids[b, :n] for b, n in enumerate(lengths)]
        known = [self.known_features(row) for row in rows]
        missing = [b for b, k in enumerate(known) if k is None]
        if missing:
            width = max(lengths[b] for b in missing)
            ids = torch.zeros(len(missing), width, dtype=input_ids.dtype)
            mask = torch.zeros(len(missing), width, dtype=torch.long)
            for j, b in enumerate(missing):
                ids[j, : lengths[b]], mask[j, : lengths[b]] = rows[b], 1
            out = self._run(ids, None if bool(mask.all()) else mask.to(ids.device), None, None, with_final)
            for j, b in enumerate(missing):
                known[b] = Captured(out.selected[j, : lengths[b]], out.final_hidden[j, : lengths[b]] if with_final else None)
            self.computed_tokens += sum(lengths[b] for b in missing)
        self.tokens_reused += sum(n for b, n in enumerate(lengths) if b not in missing)
        width, sample = input_ids.shape[1], known[0]
        selected = sample.selected.new_zeros(len(rows), width, sample.selected.shape[-1], device=self.output_device)
        final = sample.selected.new_zeros(len(rows), width, self.decoder.norm.weight.shape[0], device=self.output_device) if with_final else None
        for b, k in enumerate(known):
            selected[b, : lengths[b]] = k.selected
            if final is not None:
                final[b, : lengths[b]] = k.final_hidden
        return Captured(selected, final)

    def decode_step(self, input_ids, attention_mask, position_ids, cache) -> None:
        """One more decoder forward extending `cache` (inside record_forwards(): recorded like a decode step)."""
        self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                     **{self.cache_kwarg: cache})

    def capture_with_cache(self, input_ids, attention_mask=None, past_key_values=None, position_ids=None):
        """capture() that creates the DynamicCache if needed and returns it: (Captured, cache)."""
        if past_key_values is None:
            from transformers import DynamicCache

            past_key_values = DynamicCache(config=self.model.config)
        out = self.capture(input_ids, attention_mask, past_key_values=past_key_values, position_ids=position_ids)
        return out, past_key_values


def crop_cache(cache, length: int) -> None:
    """Cut an HF cache back to its first `length` positions (negative crop works on every 5.x)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def make_capture(backend: str, model=None, layer_ids=None, **kwargs) -> FeatureCapture:
    """The in-process capture ("hf": forward hooks). vLLM captures through engines/vllm/capture.py; SGLang
    returns no intermediate layers, which the config refuses when it loads (target.capture_backend)."""
    if backend == "hf":
        return HFCapture(model, layer_ids, **kwargs)
    raise ValueError(f"unknown feature backend {backend!r} for in-process capture (expected 'hf')")
