"""Does the drafter look where prompt lookup would? Attention on the copy source at copyable positions.

At every continuation position a of the eval's held-out code and prose prompts where prompt lookup's first
token is right (the context already holds the answer), the copy sources are the earlier positions j < a
with token[j] == token[a] and token[j + 1] == token[a + 1]. A drafter that copies attends there from the
block. This prints, per layer and block slot, the attention mass on the sources (mean over heads, and the
best head), the best head's mass on the positions j + 1 just after them (they hold the token to copy), and
the mass a uniform spread over the context would put on the sources.

    python -m bench.bench_copy_attention outputs/testbed/snapshots/step-001085 --prompts 4
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

CATEGORIES = ("code", "prose")


def copy_sources(tokens: torch.Tensor, a: int) -> torch.Tensor:
    """[a] bool: positions j < a with token[j] == token[a] and token[j + 1] == token[a + 1]."""
    return (tokens[:a] == tokens[a]) & (tokens[1 : a + 1] == tokens[a + 1])


@torch.inference_mode()
def context_keys_values(drafter, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per draft layer, the context K/V of the whole sequence: a block at a reads their first a positions."""
    context = drafter.fuse(features)
    ctx_rope = drafter._rope(context, torch.arange(context.shape[1])[None])
    return [layer.self_attn.keys_values(context, ctx_rope) for layer in drafter.layers]


@torch.inference_mode()
def block_attention(drafter, embed, context_kv, tokens: torch.Tensor, a: int) -> list[torch.Tensor]:
    """Per draft layer, [heads, block, a] attention probabilities of the block anchored at a over the context."""
    b = drafter.block_size
    x = embed(torch.tensor([[int(tokens[a])] + [drafter.mask_token_id] * (b - 1)])).to(context_kv[0][0].dtype)
    block_rope = drafter._rope(x, torch.arange(a, a + b)[None])
    probs = []
    for layer, (k_all, v_all) in zip(drafter.layers, context_kv):
        attn = layer.self_attn
        k_ctx, v_ctx = k_all[:, :, :a], v_all[:, :, :a]
        _, q, k_block = attn(layer.input_layernorm(x), block_rope, k_ctx, v_ctx, return_qk=True)
        k = torch.cat([k_ctx, k_block], dim=2).repeat_interleave(attn.n_heads // attn.n_kv_heads, 1)
        probs.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim), -1)[0, :, :, :a])
        x = layer(x, block_rope, k_ctx, v_ctx)
    return probs


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.bench_heldout_tau import continuations
    from bench.bench_learning_curve import lookup_hits
    from configs.paths import default_cache_dir
    from drafters.target.capture import HFCapture
    from drafters.drafter.checkpoint import load_drafter
    from drafters.target.frozen import FrozenTargetHead

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter", help="serving-format drafter folder")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed target)")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per category")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    target = Path(args.target) if args.target else default_cache_dir() / "targets" / "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    traces = continuations(model, AutoTokenizer.from_pretrained(target), args.prompts, args.new_tokens, CATEGORIES)
    drafter = load_drafter(args.drafter).float().eval()
    embed = FrozenTargetHead.from_pretrained(target, dtype=torch.float32).embed
    capture = HFCapture(model, list(drafter.target_layer_ids))

    print("| category | layer | slot | positions | mass on sources, mean head | best head | on the next positions, best head "
          "| uniform | last context position |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for category in CATEGORIES:
        sums: dict[tuple[int, int], list[float]] = {}
        for sequence, n_prompt in traces[category]:
            with torch.inference_mode():
                features = capture.capture(sequence, with_final=False).selected
            tokens = sequence[0]
            context_kv = context_keys_values(drafter, features)
            for a, copyable in zip(range(n_prompt, len(tokens) - 1), lookup_hits(sequence, n_prompt).tolist()):
                sources = copy_sources(tokens, a) if copyable else None
                if sources is None or not sources.any():
                    continue
                # The positions just after the sources hold the token to copy.
                after = torch.cat([torch.zeros(1, dtype=torch.bool), sources[:-1]])
                for layer, probs in enumerate(block_attention(drafter, embed, context_kv, tokens, a)):
                    for slot in (0, 1):
                        on_sources = probs[:, slot][:, sources].sum(-1)
                        on_after = probs[:, slot][:, after].sum(-1)
                        row = [1, on_sources.mean().item(), on_sources.max().item(), on_after.max().item(),
                               sources.float().mean().item(), probs[:, slot, -1].mean().item()]
                        sums[(layer, slot)] = [s + r for s, r in zip(sums.get((layer, slot), [0.0] * 6), row)]
        for (layer, slot), (n, mean, best, after, uniform, last) in sorted(sums.items()):
            print(f"| {category} | {layer + 1} | {slot} | {int(n)} | {mean / n:.3f} | {best / n:.3f} | {after / n:.3f} "
                  f"| {uniform / n:.3f} | {last / n:.3f} |")
    capture.remove()


if __name__ == "__main__":
    main()
