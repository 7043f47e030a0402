"""The drafter's training step with its attention in groups of blocks, side by side with one dense masked SDPA.

A training step's attention scores N*B block queries against [context ; N*B block slots], and the mask keeps
only each block's own slots and the context before its anchor. drafters.drafter.blocks.BlockAttention runs it in
groups of consecutive blocks instead, so that it skips most of what the mask throws away. This times the
drafter's forward and backward (bf16 autocast, as training runs on a CPU that multiplies bf16, with the
copy heads' attention and a loss on the draft hidden states) at the quickstart's shapes: SmolLM2-135M
target, 2 draft layers, 9 key/value heads, blocks of 8, 64 sorted anchors per sequence, batch 4. Every
group size runs once per round, in rotating order, and the median per round is reported.

    python -m bench.bench_block_attention --contexts 576 1024 --groups 64 16 8 4 --rounds 3 --steps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from configs.schema import DrafterConfig
from drafters.drafter.blocks import sample_anchors
from drafters.drafter.config import build_draft_config
from drafters.target.frozen import FrozenTargetHead
from drafters.drafter.model import DFlashDrafter
from drafters.target.testbed import prepare_testbed_target

MASK_TOKEN = 16


def main() -> None:
    from transformers import AutoConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[576, 1024], help="sequence lengths")
    parser.add_argument("--groups", type=int, nargs="+", default=[64, 16, 8, 4], help="blocks per SDPA call")
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--copy-heads", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per group size and round")
    args = parser.parse_args()

    folder = prepare_testbed_target()
    head = FrozenTargetHead.from_pretrained(folder, dtype=torch.bfloat16)
    config = build_draft_config(DrafterConfig(num_layers=2, block_size=args.block_size, num_target_features=5,
                                              num_key_value_heads=9), AutoConfig.from_pretrained(folder), MASK_TOKEN)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).train()
    results = {}
    for length in args.contexts:
        g = torch.Generator().manual_seed(length)
        feats = torch.randn(args.batch_size, length, 5 * config.hidden_size, generator=g).bfloat16()
        ids = torch.randint(0, head.vocab_size, (args.batch_size, length), generator=g)
        anchors, _ = sample_anchors(torch.ones(args.batch_size, length, dtype=torch.bool), args.anchors, g)

        def step():
            drafter.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                hidden, copy_logp = drafter(feats, ids, anchors, head.embed, copy_heads=args.copy_heads)
            loss = hidden.float().pow(2).mean() - copy_logp.clamp(min=-30).mean()
            loss.backward()
            return hidden.detach().float()

        outputs, times = {}, {group: [] for group in args.groups}
        for r in range(args.rounds):
            for group in args.groups[r % len(args.groups):] + args.groups[: r % len(args.groups)]:
                drafter.attention_group_blocks = group
                outputs[group] = step()  # warm-up, and the output to compare
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[group].append((time.perf_counter() - start) / args.steps)
        dense = outputs[max(args.groups)]
        results[str(length)] = {
            str(group): {"step_s": round(statistics.median(times[group]), 4),
                         "max_abs_diff_vs_largest_group": float((outputs[group] - dense).abs().max())}
            for group in args.groups
        }
    print(json.dumps({"bench": "block_attention", "anchors": args.anchors, "block_size": args.block_size,
                      "batch_size": args.batch_size, "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
