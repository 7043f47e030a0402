"""Held-out acceptance length of drafters, teacher forced: the fast check used to compare training recipes.

On the evaluation's own held-out code and prose prompts (eval.traces.heldout_traces), the target (fp32, as
in the eval) writes its greedy continuation once with eval's `target_generate`; then every drafter drafts a
block at every continuation position and slot k counts as accepted while slots 1..k match the target's
tokens. That is exactly the `sim tau` of `dflash-pipeline eval` (which matches decoded tau within
~0.01 on the testbed), without the decoding of drafters, prompt lookup and the target alone:

    python -m bench.bench_heldout_tau outputs/testbed other=/tmp/run/checkpoints/step-000300

Prints one JSON line per drafter. The target's continuations are kept in --cache.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def continuations(target, tokenizer, prompts: int, new_tokens: int, categories=("code", "prose"),
                  trajectories: list[str] | None = None) -> dict:
    """{category: [(sequence [1, T], n_prompt)]}: each held-out prompt and the target's greedy answer; the agentic
    category's prompts are the last request of each held-out session in `trajectories`."""
    from engines.hf.generation import stop_token_ids
    from drafters.decoding.spec_decode import target_generate
    from eval.traces import agentic_traces, heldout_traces

    stop_ids = stop_token_ids(target, tokenizer)
    out = {}
    for category in categories:
        rows = []
        traces = (agentic_traces(trajectories, len(tokenizer), max_prompts=prompts, max_new_tokens=new_tokens,
                                 max_positions=target.config.max_position_embeddings)
                  if category == "agentic" else
                  heldout_traces(category, tokenizer, max_prompts=prompts, max_new_tokens=new_tokens))
        for trace in traces.traces:
            answer = target_generate(target, torch.tensor([trace.input_ids]), new_tokens, stop_ids).tokens
            rows.append((torch.tensor([trace.input_ids + answer]), len(trace.input_ids)))
        out[category] = rows
    return out


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafters.target.capture import HFCapture
    from drafters.drafter.checkpoint import find_drafter_folder, load_drafter
    from drafters.target.frozen import FrozenTargetHead
    from eval.inputs import parse_drafter_arg
    from eval.measures import teacher_forced_slots
    from configs.paths import default_cache_dir
    from drafters.drafter.objective import acceptance_stats

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="+", help="[NAME=]drafter folder, checkpoint or training output_dir")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed target)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts per category")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache", default="outputs/bench/heldout_continuations.pt")
    args = parser.parse_args(argv)

    target = Path(args.target) if args.target else default_cache_dir() / "targets" / "SmolLM2-135M-Instruct"
    specs = [parse_drafter_arg(arg) for arg in args.drafters]
    drafters = {name: load_drafter(find_drafter_folder(path), dtype=torch.float32).eval() for name, path in specs}
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    cache = Path(args.cache)
    key = {"target": str(target.resolve()), "prompts": args.prompts, "new_tokens": args.new_tokens}
    traces = torch.load(cache, weights_only=True) if cache.exists() else None
    if traces is None or traces["key"] != key:
        tokenizer = AutoTokenizer.from_pretrained(target)
        traces = {"key": key, "categories": continuations(model, tokenizer, args.prompts, args.new_tokens)}
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(traces, cache)
    head = FrozenTargetHead.from_pretrained(target, dtype=torch.float32)
    for name, drafter in drafters.items():
        capture = HFCapture(model, drafter.target_layer_ids)
        result = {"drafter": name}
        for category, rows in traces["categories"].items():
            correct, valid = [], []
            with torch.inference_mode():
                for sequence, n_prompt in rows:
                    features = capture.capture(sequence, with_final=False).selected
                    slots = teacher_forced_slots(drafter, head, features, sequence, n_prompt)
                    if slots is not None:
                        correct.append(slots[0])
                        valid.append(slots[1])
            stats = acceptance_stats(torch.cat(correct), torch.cat(valid))
            result[category] = {"sim_tau": round(stats["sim_tau"], 3),
                                "slot_accuracy_1_4": [round(a, 3) for a in stats["slot_accuracy"][:4]]}
        capture.remove()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
