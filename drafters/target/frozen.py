"""The two target tensors the drafter borrows: the token embedding and the lm_head. Frozen.

`FrozenTargetHead.from_pretrained(folder)` reads exactly those tensors from the target's safetensors
(single file or sharded with an index), never building the target; a tied target yields one tensor
used for both. `from_model` wraps an already loaded target without copying.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


class FrozenTargetHead(nn.Module):
    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        vocab, hidden = embed_weight.shape
        self.lm_head = nn.Linear(hidden, vocab, bias=False, device="meta")
        if lm_head_weight is None:
            self.lm_head.weight = self.embed_tokens.weight  # tied: one tensor
        else:
            if lm_head_weight.shape != embed_weight.shape:
                raise ValueError(f"lm_head shape {tuple(lm_head_weight.shape)} != embedding shape {tuple(embed_weight.shape)}")
            self.lm_head.weight = nn.Parameter(lm_head_weight, requires_grad=False)
        self.requires_grad_(False)

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[1]

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.embed_tokens.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    @classmethod
    def from_model(cls, model: nn.Module) -> "FrozenTargetHead":
        """Share (not copy) a loaded HF target's embedding and output head."""
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        return cls(embed.detach(), None if head is embed else head.detach())

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype | None = None, device=None) -> "FrozenTargetHead":
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        text = config.get("text_config", config)
        tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
        shard_of = _tensor_locations(folder)
        embed_name = _find(shard_of, EMBED_NAMES, "embed_tokens.weight", folder)
        head_name = None
        if not tie:
            try:
                head_name = _find(shard_of, LM_HEAD_NAMES, "lm_head.weight", folder)
            except KeyError:
                if tie is False:
                    raise
        embed = _read(folder / shard_of[embed_name], embed_name, dtype, device)
        head = _read(folder / shard_of[head_name], head_name, dtype, device) if head_name else None
        return cls(embed, head)


def _tensor_locations(folder: Path) -> dict[str, str]:
    """tensor name -> file name, from the shard index or the single model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single.name for name in f.keys()}


def _find(shard_of: dict[str, str], names: tuple[str, ...], suffix: str, folder: Path) -> str:
    for name in names:
        if name in shard_of:
            return name
    matches = [n for n in shard_of if n.endswith(suffix) and "mtp" not in n]
    if len(matches) == 1:
        return matches[0]
    raise KeyError(f"{folder}: no unique tensor named like {names[0]!r} (candidates: {matches[:5]})")


def _read(path: Path, name: str, dtype, device) -> torch.Tensor:
    # safetensors names devices its own way ("cpu:0" is refused): read on the CPU, then move.
    with safe_open(path, framework="pt", device="cpu") as f:
        tensor = f.get_tensor(name)
    return tensor.to(device=device or "cpu", dtype=dtype or tensor.dtype)
