"""The target as its owner ships it: config, tokenizer and model folders, with the folder's own code when
`target.trust_remote_code` allows it (Kimi K2's tokenizer and model classes live in its checkpoint).

Every load of the target goes through here, so the setting reaches all of them; a folder that needs its
own code and was not trusted gets an error that names the setting.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from drafters.target.attention import use_on_cpu


class TargetLoadError(ValueError):
    """The target folder cannot be loaded as configured; the message names the folder and the setting."""


def _needs_trust(err: Exception) -> bool:
    text = str(err)
    return "trust_remote_code" in text or "custom code" in text


def _load(what: str, path, trust_remote_code: bool, load):
    try:
        return load()
    except (ValueError, OSError, KeyError) as err:
        if not trust_remote_code and _needs_trust(err):
            raise TargetLoadError(
                f"the target's {what} at {path} ships its own code (auto_map), which runs only with "
                f"target.trust_remote_code: true (set it if you trust that folder)") from None
        raise


def load_target_config(path: str | Path, trust_remote_code: bool = False):
    return _load("config", path, trust_remote_code,
                 lambda: AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code))


def load_target_tokenizer(path: str | Path, trust_remote_code: bool = False):
    return _load("tokenizer", path, trust_remote_code,
                 lambda: AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code))


def load_target_model(path: str | Path, *, dtype, device_map=None, trust_remote_code: bool = False,
                      offload_folder: str | Path | None = None):
    """The frozen target: eval mode, no gradients; `device_map` ("auto", a device, a dict) shards it, and
    modules mapped to "disk" are paged in from `offload_folder`. On the CPU it attends with grouped-query
    SDPA (drafters/target/attention.py)."""
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if offload_folder is not None:
        kwargs["offload_folder"] = str(offload_folder)
    model = _load("model", path, trust_remote_code, lambda: AutoModelForCausalLM.from_pretrained(str(path), **kwargs))
    contiguous_head_input(model)
    return use_on_cpu(model).eval().requires_grad_(False)


def contiguous_head_input(model) -> None:
    """Hands the vocabulary projection a contiguous input. A prefill projects only its last position, a strided
    slice of the hidden states, and torch's matmul takes a strided [B, 1, H] by expanding the head to [B, H, V] and
    copying it: 5.7 s against 0.025 s for a batch of 64 at SmolLM2's vocabulary, with the same numbers (BENCHMARKS.md,
    "A decoding cache and a contiguous head row")."""
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]) if args else None)
