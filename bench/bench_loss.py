"""Loss throughput and peak memory at Kimi's vocabulary: chunked (ours) vs naive full-vocab logits.

    python bench/bench_loss.py [--anchors 512] [--hidden 256] [--vocab 163840] [--chunk 1024]

Each variant runs forward + backward in a fresh subprocess (peak RSS is per process) under a 20 GiB
address-space cap, so a naive run that would exhaust the machine reports "out of memory" instead.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from drafters.drafter.objective import BlockTargets, block_loss, slot_weights

MEMORY_CAP = 20 * 2**30


def inputs(anchors: int, block: int, hidden: int, vocab: int, seq: int):
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(1, anchors, block, hidden, generator=g, requires_grad=True)
    target = torch.randn(1, seq, hidden, generator=g)
    head = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(torch.bfloat16)
    starts = torch.randperm(seq - block, generator=g)[:anchors].sort().values
    positions = starts[:, None] + torch.arange(1, block)
    targets = BlockTargets(positions=positions[None], valid=torch.ones(1, anchors, block - 1, dtype=torch.bool))
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    return draft, target, head, targets, ids


def naive_loss(draft, target, head, targets, gamma):
    rows = targets.valid.nonzero(as_tuple=True)
    pos = targets.positions[rows]
    d = F.log_softmax((draft[:, :, 1:][rows].to(head.dtype) @ head.T).float(), -1)
    with torch.no_grad():
        t = F.log_softmax((target[rows[0], pos - 1].to(head.dtype) @ head.T).float(), -1)
    w = slot_weights(draft.shape[2], gamma)[rows[2]]
    return ((t.exp() * (t - d)).sum(-1) * w).sum() / w.sum()


def run_variant(args) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    draft, target, head, targets, ids = inputs(args.anchors, 16, args.hidden, args.vocab, args.seq)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        start = time.perf_counter()
        if args.variant == "chunked":
            loss = block_loss(draft, targets, target, ids, head, gamma=7.0, chunk_rows=args.chunk).loss
        else:
            loss = naive_loss(draft, target, head, targets, 7.0)
        loss.backward()
        seconds = time.perf_counter() - start
    except (MemoryError, RuntimeError) as err:
        return {"variant": args.variant, "error": f"out of memory under the {MEMORY_CAP >> 30} GiB cap ({type(err).__name__})"}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = int(targets.valid.sum())
    return {
        "variant": args.variant, "rows": rows, "seconds": round(seconds, 3),
        "block_tokens_per_s": round(args.anchors * 16 / seconds, 1),
        "peak_extra_mib": round((peak - base_rss) / 1024, 1), "loss": round(loss.item(), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=163_840)
    parser.add_argument("--seq", type=int, default=3072)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--variant", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    results = {"bench": "loss", "vocab": args.vocab, "anchors": args.anchors, "block": 16, "hidden": args.hidden,
               "chunk_rows": args.chunk, "torch_threads": torch.get_num_threads(), "runs": []}
    for variant in ("chunked", "naive"):
        cmd = [sys.executable, __file__, "--variant", variant, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        results["runs"].append(json.loads(lines[-1]) if lines else {"variant": variant, "error": out.stderr[-500:]})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
