"""Cross-check against the z-lab reference decoder (PyPI ``dflash`` 0.1.0, module ``dflash.model``).

The same checkpoint is loaded with ``DFlashDraftModel.from_pretrained`` in the same dtype as our drafter
and decoded with ``dflash_generate`` against the same target instance. An FP8 export, which the
reference cannot load, is dequantized exactly as our loader does (``drafters.export.fp8``), written to a
temporary reference-format folder and loaded from there, so both decoders run the same weights.

The reference times itself with ``_cuda_time`` (``torch.cuda.synchronize()`` + ``perf_counter``); on a
machine without CUDA that attribute of the reference module is replaced by ``time.perf_counter`` for the
duration of a call (:func:`cpu_timing`) and restored afterwards. It is not our code and is never edited.

A drafter with a sliding window declares it as vLLM reads it (``dflash_config.use_swa``); the reference reads a
window from Qwen3's ``layer_types`` / ``sliding_window`` and ``is_causal`` instead, so those are set on its config
(non-causal, as the drafter is trained and as vLLM serves it).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import torch

from transformers import Qwen3Config

from drafters.decoding.spec_decode import Decoded
from drafters.drafter.checkpoint import save_drafter
from drafters.drafter.model import draft_window


def reference_module():
    try:
        import dflash.model as reference
    except ImportError as err:
        raise RuntimeError("the reference cross-check needs z-lab's `dflash` package: "
                           "pip install --no-deps dflash==0.1.0 (or bash scripts/setup.sh)") from err
    return reference


@contextlib.contextmanager
def cpu_timing():
    """Let the reference's CUDA-only timer run on the CPU (restored on exit)."""
    reference = reference_module()
    if torch.cuda.is_available():
        yield
        return
    original = reference._cuda_time
    reference._cuda_time = time.perf_counter
    try:
        yield
    finally:
        reference._cuda_time = original


def load_reference_model(folder: str | Path, dtype: torch.dtype, *, fp8: bool = False, ours=None, device=None):
    """``DFlashDraftModel.from_pretrained(folder, dtype=dtype)``; for an FP8 export, the dequantized weights
    of ``ours`` (our loaded drafter) are written to a temporary folder first."""
    reference = reference_module()
    if not fp8:
        model = reference.DFlashDraftModel.from_pretrained(str(folder), config=reference_config(folder), dtype=dtype)
    else:
        if ours is None:
            raise ValueError("an FP8 export needs our dequantized drafter to build the reference copy")

        with tempfile.TemporaryDirectory(prefix="dflash-ref-") as tmp:
            path = save_drafter(ours, Path(tmp) / "drafter", dtype=dtype)
            model = reference.DFlashDraftModel.from_pretrained(str(path), config=reference_config(path), dtype=dtype)
            model = model.to(dtype)  # materialize before the temporary folder goes away
    if device is not None:
        model = model.to(device)
    return model.eval()


def reference_config(folder: str | Path) -> Qwen3Config:
    """The drafter's config, with its sliding window (if any) where the reference reads one."""
    config = Qwen3Config.from_pretrained(str(folder))
    window = draft_window(config)
    if window is not None:  # set after Qwen3Config's own checks, which drop a window use_sliding_window does not ask for
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        config.sliding_window = window
        config.is_causal = False
    return config


def reference_generate(model, target, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=None,
                       temperature: float = 0.0, seed: int = 0) -> Decoded:
    """One reference decode; at T > 0 the reference samples from torch's global RNG, seeded here inside
    ``torch.random.fork_rng`` so the caller's RNG state is left as it was."""
    reference = reference_module()
    n_prompt = input_ids.shape[1]
    with cpu_timing(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        started = time.perf_counter()
        out = reference.dflash_generate(model, target, input_ids.to(target.device), max_new_tokens,
                                        list(stop_ids) if stop_ids else None, temperature=temperature,
                                        return_stats=True)
        total = time.perf_counter() - started
    tokens = out.output_ids[0, n_prompt:].tolist()
    return Decoded(tokens, list(out.acceptance_lengths), float(out.time_to_first_token), total)
