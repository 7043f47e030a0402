"""A tiny target the CPU build of vLLM serves, and a drafter trained on it that accepts drafted tokens.

The engine tests need a drafter whose tau is clearly above 1 (a random drafter accepts nothing, and then
any two tau figures agree trivially). Training one on SmolLM2 takes minutes on this machine; on a chaotic
tiny Llama (testbed.tiny_llama_target's family, head size 64 so that vLLM's CPU attention takes it) a
1-layer drafter trained 60 steps on the target's greedy continuations accepts ~2 tokens per step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from configs.schema import DrafterConfig
from data.trajectory.reader import write_trajectories
from drafters.decoding.spec_decode import target_generate
from drafters.drafter.checkpoint import save_drafter
from drafters.drafter.config import build_draft_config
from drafters.drafter.model import DFlashDrafter
from drafters.drafter.objective import block_loss, block_targets, default_gamma
from drafters.target.capture import HFCapture
from drafters.target.frozen import FrozenTargetHead

VOCAB, BLOCK, NEW = 512, 8, 40


def tiny_engine_target(seed: int = 0):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random weights x 8: a chaotic target whose greedy text is not a constant
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return model


def save_chat_engine_target(out_dir: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """tiny_engine_target's shape with SmolLM2's vocabulary, tokenizer and chat template (copied from
    tokenizer_from, the testbed target): a chat model vLLM's CPU build serves, for the tests that walk the
    production path (prepare from chat prompts, serve, log, retrain) in seconds instead of minutes."""
    config = LlamaConfig(vocab_size=49_152, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tokenizer_from) / name, Path(out_dir) / name)
    return Path(out_dir)


def train_on_greedy_continuations(target, prompts, draft_config, new_tokens: int, stop_ids, steps: int = 60):
    """A drafter fitted (CE, every anchor of each continuation) to the target's greedy continuations of prompts."""
    block = draft_config.block_size
    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config)
    head = FrozenTargetHead.from_model(target)
    capture = HFCapture(target, drafter.target_layer_ids)
    batch = []
    for p in prompts:
        seq = torch.tensor([p[0].tolist() + target_generate(target, p, new_tokens, stop_ids).tokens])
        mask = torch.zeros_like(seq, dtype=torch.bool)
        mask[:, p.shape[1]:] = True
        anchors = torch.arange(p.shape[1] - 1, seq.shape[1] - 1)[None]
        batch.append((seq, capture.capture(seq, with_final=False).selected, anchors,
                      block_targets(anchors, torch.ones_like(anchors, dtype=torch.bool), mask, block)))
    capture.remove()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        for seq, feats, anchors, targets in batch:
            hidden = drafter(feats, seq, anchors, head.embed)
            block_loss(hidden, targets, None, seq, head.lm_head.weight, gamma=default_gamma(block), kind="ce").loss.backward()
        opt.step()
    return drafter


def build(root: Path) -> dict:
    """Saves the target, a three-session agent log (token ids) and a trained drafter under root."""
    root.mkdir(parents=True, exist_ok=True)
    target = tiny_engine_target()
    target.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB - 12, (1, 24), generator=g) for _ in range(3)]
    records = []
    for i, p in enumerate(prompts):
        for t, ids in enumerate([p[0, :12].tolist(), p[0].tolist()]):
            records.append({"session_id": f"s{i}", "request_id": f"s{i}-t{t}", "timestamp": 1_700_000_000 + t,
                            "parent_request_id": f"s{i}-t{t - 1}" if t else None,
                            "input_ids": [int(x) for x in ids], "output_ids": [5, 6, 7]})
    write_trajectories(records, root / "agent.jsonl")

    config = build_draft_config(DrafterConfig(num_layers=1, block_size=BLOCK, num_target_features=3, num_key_value_heads=2),
                                target.config, VOCAB - 1)
    drafter = train_on_greedy_continuations(target, prompts, config, NEW, [2])
    drafter_dir = save_drafter(drafter.eval(), root / "trained")
    return {"target": root / "target", "log": root / "agent.jsonl", "drafter": Path(drafter_dir)}


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1])))
