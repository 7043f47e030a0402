"""How much of a drafter's acceptance is memory: teacher-forced tau on prompts it trained on against held-out ones.

A category whose trained-on tau is far above its held-out tau is learned per subject (the drafter recalls the
answers it saw) rather than in general; more prompts about the same subjects will not close that gap, new
subjects may. The trained-on rows are the prepared mixture's own (the target's regenerated answers, cut to
--new-tokens); the held-out rows are the learning curve's (bench/bench_learning_curve.py), scored the same way:

    python -m bench.bench_memory_gap outputs/testbed-full/snapshots/step-004952 \
        --dataset ~/.cache/dflash-pipeline/datasets/mixture-<key>/dataset --categories code,chat,writing

Prints one JSON line per category and writes a markdown table to --out.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch


def trained_rows(dataset, category: str, count: int, new_tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """[(sequence [1, T], n_prompt)] for `count` seeded rows of `category`: the prompt and the first `new_tokens`
    tokens of the target's regenerated answer."""
    indices = [i for i, c in enumerate(dataset["category"]) if c == category]
    if not indices:
        raise SystemExit(f"--categories {category}: the dataset has no row of that category")
    random.Random(seed).shuffle(indices)
    rows = []
    for i in indices[:count]:
        row = dataset[i]
        n_prompt = row["num_prompt_tokens"]
        rows.append((torch.tensor([row["input_ids"][: n_prompt + new_tokens]]), n_prompt))
    return rows


def share(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None) -> None:
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.bench_heldout_tau import continuations
    from bench.bench_learning_curve import score
    from common.atomic_files import write_text_atomic
    from configs.paths import default_cache_dir
    from drafters.drafter.checkpoint import load_drafter
    from drafters.target.capture import HFCapture
    from drafters.target.frozen import FrozenTargetHead

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter", help="a serving-format drafter folder (a snapshot or a run's final drafter)")
    parser.add_argument("--dataset", required=True, help="the prepared mixture's dataset folder the drafter trained on")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed target)")
    parser.add_argument("--categories", default="code,chat,writing")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per category and side")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", default="outputs/bench/memory-gap")
    args = parser.parse_args(argv)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]

    target = Path(args.target) if args.target else default_cache_dir() / "targets" / "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    dataset = load_from_disk(args.dataset)
    sides = {"trained": {c: trained_rows(dataset, c, args.prompts, args.new_tokens) for c in categories},
             "heldout": continuations(model, tokenizer, args.prompts, args.new_tokens, categories)}
    drafter = load_drafter(args.drafter, dtype=torch.float32).eval()
    head = FrozenTargetHead.from_pretrained(target, dtype=torch.float32)
    capture = HFCapture(model, list(drafter.target_layer_ids))
    results = {}
    with torch.inference_mode():
        for side, rows_of in sides.items():
            features = {(c, i): capture.capture(seq, with_final=False).selected
                        for c, rows in rows_of.items() for i, (seq, _) in enumerate(rows)}
            results[side] = score(drafter, head, lambda c, i: features[(c, i)], rows_of)
    capture.remove()

    lines = ["| category | trained-on tau / slot 1 / slot 1 copyable | held-out tau / slot 1 / slot 1 copyable | gap in tau |",
             "|---|---|---|---:|"]
    for c in categories:
        t, h = results["trained"][c], results["heldout"][c]
        print(json.dumps({"category": c, "trained": t, "heldout": h}), flush=True)
        lines.append(f"| {c} | {t['sim_tau']:.3f} / {t['slot1']:.3f} / {share(t['slot1_copyable'])} | "
                     f"{h['sim_tau']:.3f} / {h['slot1']:.3f} / {share(h['slot1_copyable'])} | {t['sim_tau'] - h['sim_tau']:+.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "memory_gap.md", "\n".join(lines) + "\n")
    print(f"wrote {out / 'memory_gap.md'}")


if __name__ == "__main__":
    main()
