"""Held-out acceptance length of drafters, teacher forced: the fast check used to compare training recipes.

On the evaluation's own held-out code and prose prompts (eval.traces.heldout_traces), the target writes its
greedy continuation once (batched, bf16) and its features are captured once; then every drafter drafts a
block at every continuation position and slot k counts as accepted while slots 1..k match the target's
tokens. That is the `sim tau` of `python -m eval.acceptance`, which matches decoded tau within ~0.01 on
the testbed, at a small fraction of the cost of decoding (no prompt-lookup or target-alone runs):

    python -m bench.bench_heldout_tau outputs/testbed other=/tmp/run/checkpoints/step-000300

Prints one JSON line per drafter. The target's continuations and features are kept in --cache.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def build_traces(target_path: Path, layer_ids: list[int], prompts: int, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafters.capture import HFCapture
    from eval.traces import heldout_traces

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.bfloat16).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    capture = HFCapture(model, layer_ids)
    out = {}
    for category in ("code", "prose"):
        traces = heldout_traces(category, tokenizer, max_prompts=prompts, max_new_tokens=new_tokens).traces
        width = max(len(t.input_ids) for t in traces)
        ids = torch.tensor([[pad] * (width - len(t.input_ids)) + t.input_ids for t in traces])
        attention = (torch.arange(width)[None] >= torch.tensor([width - len(t.input_ids) for t in traces])[:, None]).long()
        with torch.inference_mode():
            generated = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=new_tokens,
                                       do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
        rows = []
        for trace, row in zip(traces, generated[:, width:].tolist()):
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            sequence = torch.tensor([trace.input_ids + row])
            with torch.inference_mode():
                features = capture.capture(sequence, torch.ones_like(sequence)).selected.to(torch.bfloat16)
            rows.append({"sequence": sequence, "n_prompt": len(trace.input_ids), "features": features})
        out[category] = rows
    capture.remove()
    return out


def main(argv=None) -> None:
    from drafters.checkpoint import find_drafter_folder, load_drafter
    from drafters.frozen_target import FrozenTargetHead
    from eval.acceptance import parse_drafter_arg, teacher_forced_slots
    from scripts.testbed import default_cache_dir
    from train.loss import acceptance_stats

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="+", help="[NAME=]drafter folder, checkpoint or training output_dir")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed target)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts per category")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache", default="outputs/bench/heldout_tau.pt")
    args = parser.parse_args(argv)

    target = Path(args.target) if args.target else default_cache_dir() / "targets" / "SmolLM2-135M-Instruct"
    specs = [parse_drafter_arg(arg) for arg in args.drafters]
    drafters = {name: load_drafter(find_drafter_folder(path), dtype=torch.float32).eval() for name, path in specs}
    layer_ids = next(iter(drafters.values())).target_layer_ids
    cache = Path(args.cache)
    key = {"target": str(target.resolve()), "layers": layer_ids, "prompts": args.prompts, "new_tokens": args.new_tokens}
    traces = torch.load(cache) if cache.exists() else None
    if traces is None or traces["key"] != key:
        traces = {"key": key, "categories": build_traces(target, layer_ids, args.prompts, args.new_tokens)}
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(traces, cache)
    head = FrozenTargetHead.from_pretrained(target, dtype=torch.float32)
    for name, drafter in drafters.items():
        if drafter.target_layer_ids != layer_ids:
            raise SystemExit(f"drafter {name!r} reads target layers {drafter.target_layer_ids}, the cached traces {layer_ids}")
        result = {"drafter": name}
        for category, rows in traces["categories"].items():
            correct, valid = [], []
            with torch.inference_mode():
                for row in rows:
                    slots = teacher_forced_slots(drafter, head, row["features"].float(), row["sequence"], row["n_prompt"])
                    if slots is not None:
                        correct.append(slots[0])
                        valid.append(slots[1])
            stats = acceptance_stats(torch.cat(correct), torch.cat(valid))
            result[category] = {"sim_tau": round(stats["sim_tau"], 3),
                                "slot_accuracy_1_4": [round(a, 3) for a in stats["slot_accuracy"][:4]]}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
