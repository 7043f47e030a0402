"""Which combination of prompt lookup and the drafter to serve: every rule replayed on the same greedy decodes.

    python -m bench.bench_combination --drafter stage2=outputs/qs-stage2 --traces code,agentic \
        --trajectories outputs/agentic-heldout --prompts 8 --max-new-tokens 128

At T = 0 the output is the target's greedy continuation whatever proposes the drafts, and the drafter's draft at
an anchor depends only on the committed tokens' features. So per prompt the target decodes once, the drafter's
block is computed teacher forced at every anchor of the continuation (``eval.measures.teacher_forced_slots``, the
eval's sim tau), prompt lookup's draft at every anchor (``ngram_lookup``), and each rule is replayed step by step:
it picks a draft, the target accepts its longest right prefix plus one token, and the next anchor follows. tau is
committed tokens per step, as the eval decodes it (``dflash-pipeline eval`` checks the rule it serves by real
decoding: column ``<name>+lookup``).

Rules:
  drafter, lookup                 one proposer alone (lookup: no draft without a match)
  lookup>=N else drafter          lookup's draft where the context's last N tokens recur (N = 1, 2, 3), else the
                                  drafter's (``DrafterWithLookup``, ``eval.with_lookup_min_match``)
  agree or lookup>=3              lookup's draft where its first token is the drafter's first, or its match is 3+
                                  tokens long; else the drafter's
  better per step                 the draft that commits more at every step: not a bound (committing more now moves
                                  the later anchors), but what a perfect choice of one draft per step gets
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from drafters.decoding.proposers import ngram_lookup
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
from eval.measures import teacher_forced_slots
from eval.traces import agentic_traces, heldout_traces


def match_length(context: np.ndarray, max_ngram: int) -> int:
    """The longest n <= max_ngram whose last-n tokens recur earlier in the context (0: none)."""
    for n in range(max_ngram, 0, -1):
        if ngram_lookup(context, n, n, 1):
            return n
    return 0


def accepted(draft: list[int], truth: list[int]) -> int:
    count = 0
    for proposed, right in zip(draft, truth):
        if proposed != right:
            break
        count += 1
    return count


def per_anchor(drafter, head, target, prompt: list[int], truth: list[int], num_draft: int) -> list[dict]:
    """At every anchor of the continuation: each proposer's accepted count and what the rules look at."""
    sequence = torch.tensor([prompt + truth])
    capture = HFCapture(target, list(drafter.target_layer_ids))
    try:
        features = capture.capture(sequence, with_final=False).selected
    finally:
        capture.remove()
    correct, valid = teacher_forced_slots(drafter, head, features, sequence, len(prompt))
    drafter_accepts = (correct & valid).long().cumprod(dim=1).sum(dim=1).tolist()
    drafter_first = (correct[:, 0]).tolist()
    ids = np.array(prompt + truth)
    anchors = []
    for i, a in enumerate(range(len(prompt), len(ids) - 1)):
        context = ids[: a + 1]
        lookup = ngram_lookup(context, 3, 1, num_draft)
        rest = ids[a + 1:].tolist()
        lookup_accepts = accepted(lookup, rest)
        # Where both first tokens are wrong, either draft commits one token: "agree" only matters where one is
        # right, and there the two agree exactly when both are.
        anchors.append({"drafter": drafter_accepts[i], "lookup": lookup_accepts,
                        "match": match_length(context, 3) if lookup else 0,
                        "agree": lookup_accepts > 0 and bool(drafter_first[i])})
    return anchors


RULES = {
    "drafter": lambda s: "drafter",
    "lookup": lambda s: "lookup",
    "lookup>=1 else drafter": lambda s: "lookup" if s["match"] >= 1 else "drafter",
    "lookup>=2 else drafter": lambda s: "lookup" if s["match"] >= 2 else "drafter",
    "lookup>=3 else drafter": lambda s: "lookup" if s["match"] >= 3 else "drafter",
    "agree or lookup>=3": lambda s: "lookup" if s["agree"] or s["match"] >= 3 else "drafter",
    "better per step": lambda s: "lookup" if s["lookup"] > s["drafter"] else "drafter",
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
    result = {}
    for spec_arg in args.drafter:
        spec = resolve_drafter(spec_arg)
        drafter = load_spec(spec, torch.float32, target_config)
        for category, ts in sets.items():
            steps = {name: [] for name in RULES}
            for trace, truth in zip(ts.traces, truths[category]):
                anchors = per_anchor(drafter, head, target, trace.input_ids, truth, args.lookup_num_draft)
                for name, rule in RULES.items():
                    steps[name] += replay(anchors, rule, len(truth))
            result.setdefault(spec.name, {})[category] = {name: sum(s) / len(s) for name, s in steps.items()}
    lines = ["| drafter | traffic | " + " | ".join(RULES) + " |", "|---|---|" + "---:|" * len(RULES)]
    for name, per in result.items():
        for category, taus in per.items():
            lines.append(f"| {name} | {category} | " + " | ".join(f"{taus[r]:.2f}" for r in RULES) + " |")
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "combination.json").write_text(json.dumps({"args": vars(args), "tau": result,
                                                      "seconds": time.perf_counter() - started}, indent=1))
    (out / "combination.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
