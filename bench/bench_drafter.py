"""Drafter step times at the testbed's shapes (SmolLM2-135M target: H 576, K 5, 2 draft layers, block 16).

  python bench/bench_drafter.py [--contexts 512 1024 2048] [--anchors 32] [--dtypes bfloat16 float32]

Training: the drafter's training forward over one sequence with N anchors + backward, with the loss on the draft hidden
states only ("drafter"), and with a CE over the 49,152-token lm_head on every drafted slot added
("drafter+lm_head"), which is what a real step pays. Inference: one `step` (a few new context tokens
+ one block) against a draft cache holding the whole context, alone and with the 15 slots' logits.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from configs.schema import DrafterConfig
from drafters.drafter.config import build_draft_config
from drafters.target.frozen import FrozenTargetHead
from drafters.drafter.model import DFlashDrafter, DraftCache
from drafters.target.testbed import prepare_testbed_target

MASK_TOKEN = 16


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def bench(dtype: torch.dtype, contexts, anchors: int, reps: int) -> dict:
    from transformers import AutoConfig

    folder = prepare_testbed_target()
    target_config = AutoConfig.from_pretrained(folder)
    head = FrozenTargetHead.from_pretrained(folder, dtype=dtype)
    config = build_draft_config(DrafterConfig(num_layers=2, block_size=16, num_target_features=5), target_config, MASK_TOKEN)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(dtype)
    k_h, block = 5 * config.hidden_size, drafter.block_size
    results = {}
    for t in contexts:
        g = torch.Generator().manual_seed(t)
        feats = torch.randn(1, t, k_h, generator=g).to(dtype)
        ids = torch.randint(0, head.vocab_size, (1, t), generator=g)
        anchor_pos = torch.randperm(t - block, generator=g)[:anchors].sort().values[None] + 1
        labels = ids[0, (anchor_pos[..., None] + torch.arange(1, block)).clamp(max=t - 1)].flatten()

        def train_step(with_head: bool):
            drafter.zero_grad(set_to_none=True)
            hidden = drafter(feats, ids, anchor_pos, head.embed)
            if with_head:
                logits = head.logits(hidden[:, :, 1:].flatten(0, 2)).float()
                loss = torch.nn.functional.cross_entropy(logits, labels)
            else:
                loss = hidden.float().pow(2).mean()
            loss.backward()

        drafter.train()
        row = {
            "train_step_drafter_s": timed(lambda: train_step(False), reps),
            "train_step_drafter+lm_head_s": timed(lambda: train_step(True), reps),
        }
        drafter.eval()
        with torch.no_grad():
            cache = DraftCache()
            drafter.step(feats[:, : t - 4], head.embed(torch.full((1, block), MASK_TOKEN)), t - 4, cache)
            blk = head.embed(torch.full((1, block), MASK_TOKEN))

            def infer_step(with_head: bool):
                # 3 accepted tokens' features + one block; crop back so every rep sees the same context.
                hidden = drafter.step(feats[:, t - 4 : t - 1], blk, t - 1, cache)
                cache.crop(t - 4)
                if with_head:
                    head.logits(hidden[:, 1:]).argmax(-1)

            row["infer_step_drafter_ms"] = 1000 * timed(lambda: infer_step(False), reps * 5)
            row["infer_step_drafter+lm_head_ms"] = 1000 * timed(lambda: infer_step(True), reps * 5)
        results[str(t)] = {k: round(v, 4) for k, v in row.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    out = {
        "bench": "drafter", "hidden": 576, "draft_layers": 2, "block": 16, "K": 5, "anchors": args.anchors,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
    }
    for name in args.dtypes:
        out[name] = bench(getattr(torch, name), args.contexts, args.anchors, args.reps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
