"""Which combination of prompt lookup and the drafter to serve: every rule replayed on the same greedy decodes.

    python -m bench.bench_combination --drafter stage2=outputs/qs-stage2 --traces code,agentic \
        --trajectories outputs/agentic-heldout --prompts 8 --max-new-tokens 128

At T = 0 the output is the target's greedy continuation whatever proposes the drafts, and the drafter's draft at
an anchor depends only on the committed tokens' features. So per prompt the target decodes once, the drafter's
argmax block is computed teacher forced at every anchor of the continuation (as the eval's sim tau), prompt
lookup's candidates at every anchor (``ngram_matches``), and each rule is replayed step by step: it picks a draft,
the target accepts its longest right prefix plus one token, and the next anchor follows. tau is committed tokens
per step, as the eval decodes it (``dflash-pipeline eval`` checks the rule it serves by real decoding: column
``<name>+lookup``). ``anchors.json`` keeps every proposal's accepted count per anchor, to replay other rules.

Proposals at an anchor (n-grams up to 3, or up to 32 for the "long" ones, matched as long as they go):
  lookup                          the continuation of the earliest occurrence of the longest match (``ngram_lookup``)
  latest                          ... of the latest occurrence
  picked                          ... of the occurrence that agrees longest with the drafter's draft
                                  (``agreeing_continuation``; the earliest where none does)
Rules:
  drafter, lookup, latest lookup, long lookup    one proposer alone (lookup: no draft without a match)
  lookup>=N else drafter          lookup's draft where the context's last N tokens recur, else the drafter's (the
                                  drafter with lookup before it picked among occurrences)
  picked>=2 else drafter          the picked continuation where the last 2+ tokens recur, else the drafter's: what
                                  ``DrafterWithLookup`` serves (``eval.with_lookup_min_match`` 2)
  long picked>=2 else drafter     the same with ``eval.lookup_max_ngram=32``
  better per step                 the better of the drafter's and lookup's draft at every step: not a bound
                                  (committing more now moves the later anchors), but what a perfect choice gets
  best per step                   the same over every proposal above
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from drafters.decoding.proposers import agreeing_continuation, ngram_matches
from drafters.decoding.spec_decode import target_generate
from drafters.target.capture import HFCapture
from drafters.target.frozen import FrozenTargetHead
from drafters.target.loading import (
    load_target_config,
    load_target_model,
    load_target_tokenizer,
)
from drafters.target.testbed import prepare_testbed_target
from engines.hf.generation import stop_token_ids
from eval.inputs import load_spec, resolve_drafter
from eval.measures import SIM_ANCHOR_CHUNK
from eval.traces import agentic_traces, heldout_traces


def accepted(draft, truth) -> int:
    count = 0
    for proposed, right in zip(draft, truth):
        if proposed != right:
            break
        count += 1
    return count


@torch.no_grad()
def drafter_blocks(drafter, head, features: torch.Tensor, sequence: torch.Tensor, n_prompt: int):
    """The drafter's argmax block [N, B-1] at every anchor n_prompt .. T-2, teacher forced (the eval's sim tau),
    and its expected accepted count [N] by its own probabilities (the sum over slots of the running product)."""
    blocks, expected = [], []
    for lo in range(n_prompt, sequence.shape[1] - 1, SIM_ANCHOR_CHUNK):
        anchors = torch.arange(lo, min(lo + SIM_ANCHOR_CHUNK, sequence.shape[1] - 1))[None]
        hidden = drafter(features, sequence, anchors, head.embed)
        top = torch.softmax(head.logits(hidden[0, :, 1:]).float(), dim=-1).max(-1)
        blocks.append(top.indices)
        expected.append(top.values.cumprod(dim=-1).sum(dim=-1))
    return torch.cat(blocks).numpy(), torch.cat(expected).tolist()


def per_anchor(drafter, head, target, prompt: list[int], truth: list[int], num_draft: int) -> list[dict]:
    """At every anchor of the continuation: each proposal's accepted count and what the rules look at."""
    sequence = torch.tensor([prompt + truth])
    capture = HFCapture(target, list(drafter.target_layer_ids))
    try:
        features = capture.capture(sequence, with_final=False).selected
    finally:
        capture.remove()
    drafts, expected = drafter_blocks(drafter, head, features, sequence, len(prompt))
    ids = np.array(prompt + truth)
    anchors = []
    for i, a in enumerate(range(len(prompt), len(ids) - 1)):
        context, rest = ids[: a + 1], ids[a + 1:].tolist()
        step = {"drafter": accepted(drafts[i].tolist(), rest), "drafter expected": expected[i]}
        for name, max_ngram in (("", 3), ("long ", LONG_NGRAM)):
            n, starts = ngram_matches(context, max_ngram, 1)
            if n:
                lookup = context[starts[0]: starts[0] + num_draft].tolist()
                latest = context[starts[-1]: starts[-1] + num_draft].tolist()
                chosen, agree = agreeing_continuation(context, starts, drafts[i].tolist(), num_draft)
            else:
                lookup = latest = chosen = []
                agree = 0
            step |= {f"{name}lookup": accepted(lookup, rest), f"{name}latest": accepted(latest, rest),
                     f"{name}picked": accepted(chosen, rest), f"{name}match": n, f"{name}agree": agree}
        anchors.append(step)
    return anchors


LONG_NGRAM = 32  # a suffix match this long picks the occurrence by more context (SuffixDecoding's idea)

PROPOSALS = ("drafter", "lookup", "latest", "picked", "long lookup", "long latest", "long picked")

RULES = {
    "drafter": lambda s: "drafter",
    "lookup": lambda s: "lookup",
    "latest lookup": lambda s: "latest",
    "long lookup": lambda s: "long lookup",
    "lookup>=2 else drafter": lambda s: "lookup" if s["match"] >= 2 else "drafter",
    "lookup>=3 else drafter": lambda s: "lookup" if s["match"] >= 3 else "drafter",
    "picked>=2 else drafter": lambda s: "picked" if s["match"] >= 2 else "drafter",
    "long picked>=2 else drafter": lambda s: "long picked" if s["long match"] >= 2 else "drafter",
    "better per step": lambda s: "lookup" if s["lookup"] > s["drafter"] else "drafter",
    "best per step": lambda s: max(PROPOSALS, key=lambda name: s[name]),
}


def replay(anchors: list[dict], rule, new_tokens: int) -> list[int]:
    """Committed tokens per step of a decode whose every step the rule drafts (the first token is the prefill's)."""
    steps, position, committed = [], 0, 1
    while position < len(anchors) and committed < new_tokens:
        step = anchors[position]
        length = min(step[rule(step)] + 1, new_tokens - committed)
        steps.append(length)
        committed += length
        position += length
    return steps


def reach_by_slot(anchors: list[dict], proposal: str, num_draft: int) -> list[float]:
    """The share of these anchors at which the proposal's first k drafted tokens are all right, k = 1..num_draft."""
    return [sum(a[proposal] >= k for a in anchors) / max(1, len(anchors)) for k in range(1, num_draft + 1)]


def copy_table(anchor_log: dict, num_draft: int) -> str:
    """Where the drafter loses to copying: its reach per slot on the anchors prompt lookup (n-grams up to 32) gets
    at least one token right ("copyable") and on the rest, beside lookup's own reach on the copyable ones."""
    lines = ["| drafter/traffic | anchors | copyable | proposal | " + " | ".join(f"k={k}" for k in range(1, num_draft + 1))
             + " |", "|---|---:|---:|---|" + "---:|" * num_draft]
    for key, prompts in anchor_log.items():
        every = [a for p in prompts for a in p["anchors"]]
        copyable = [a for a in every if a["long lookup"] >= 1]
        rest = [a for a in every if a["long lookup"] == 0]
        for label, anchors, proposal in (("drafter, copyable", copyable, "drafter"),
                                         ("long lookup, copyable", copyable, "long lookup"),
                                         ("drafter, the rest", rest, "drafter")):
            reach = reach_by_slot(anchors, proposal, num_draft)
            lines.append(f"| {key} | {len(every)} | {len(copyable)} | {label} ({len(anchors)}) | "
                         + " | ".join(f"{r:.3f}" for r in reach) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", action="append", required=True, help="NAME=PATH")
    parser.add_argument("--traces", default="code,agentic")
    parser.add_argument("--trajectories", default=None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--lookup-num-draft", type=int, default=15, help="prompt lookup's drafts per step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="outputs/bench/combination")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_path = prepare_testbed_target()
    tokenizer = load_target_tokenizer(target_path)
    target_config = load_target_config(target_path)
    target = load_target_model(target_path, dtype=torch.float32)
    head = FrozenTargetHead.from_model(target)
    stops = stop_token_ids(target, tokenizer)
    sets = {}
    for category in args.traces.split(","):
        if category == "agentic":
            sets[category] = agentic_traces([args.trajectories], target_config.vocab_size, max_prompts=args.prompts,
                                            max_new_tokens=args.max_new_tokens)
        else:
            sets[category] = heldout_traces(category, tokenizer, max_prompts=args.prompts,
                                            max_new_tokens=args.max_new_tokens)
    started = time.perf_counter()
    truths = {c: [target_generate(target, torch.tensor([t.input_ids]), args.max_new_tokens, stops).tokens
                  for t in ts.traces] for c, ts in sets.items()}
    result, anchor_log = {}, {}
    for spec_arg in args.drafter:
        spec = resolve_drafter(spec_arg)
        drafter = load_spec(spec, torch.float32, target_config)
        for category, ts in sets.items():
            steps = {name: [] for name in RULES}
            prompts = []
            for trace, truth in zip(ts.traces, truths[category]):
                anchors = per_anchor(drafter, head, target, trace.input_ids, truth, args.lookup_num_draft)
                prompts.append({"new_tokens": len(truth), "anchors": anchors})
                for name, rule in RULES.items():
                    steps[name] += replay(anchors, rule, len(truth))
            anchor_log[f"{spec.name}/{category}"] = prompts
            result.setdefault(spec.name, {})[category] = {name: sum(s) / len(s) for name, s in steps.items()}
    lines = ["| drafter | traffic | " + " | ".join(RULES) + " |", "|---|---|" + "---:|" * len(RULES)]
    for name, per in result.items():
        for category, taus in per.items():
            lines.append(f"| {name} | {category} | " + " | ".join(f"{taus[r]:.2f}" for r in RULES) + " |")
    table = "\n".join(lines) + "\n\n" + copy_table(anchor_log, args.lookup_num_draft)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "combination.json").write_text(json.dumps({"args": vars(args), "tau": result,
                                                      "seconds": time.perf_counter() - started}, indent=1))
    (out / "combination.md").write_text(table)
    (out / "anchors.json").write_text(json.dumps(anchor_log))  # every proposal's accepted count, to replay other rules
    print(table)
    return result


if __name__ == "__main__":
    main()
