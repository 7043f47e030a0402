"""Long context: the drafter's tau and the cost of a draft step against the context length, on agent sessions.

Issue 44, "Long context": if tau at 8K is more than 10% below tau at 1K, or a draft step at 8K costs more than
2x one at 1K, the drafter needs a sliding window. This measures both on prompts of exactly L tokens per length:

    dflash-pipeline simulate --out outputs/agentic-heldout --sessions 8 --split heldout --seed 1
    python -m bench.bench_long_context --drafter outputs/testbed --trajectories outputs/agentic-heldout \\
        --lengths 1024,2048,4096,8192 --prompts 4 --max-new-tokens 64 --out outputs/bench/long_context

Prompts. The simulated sessions compact their context above ~1.5K tokens, so no logged request is 8K long.
Every request of the log is read (eval.traces.agentic_traces); a request whose ids all open the same session's
next request adds nothing to it and is dropped, which leaves the distinct requests (the last one before each
compaction, a session's last one), in log order. The prompts END with the N longest distinct requests that close
a session (the eval's choice of agentic prompt), the same N at every length, so that the continuation is the
target's next turn after a real request in the sessions' own chat template. Before it come the distinct requests
that precede it in the log (earlier segments of its session, then earlier sessions, wrapping round to the end of
the log, never one twice), whole, and the front of the joined ids is cut so that the prompt holds exactly L tokens
(a request longer than L keeps its last L). A long prompt is therefore several conversations one after another,
as a long-running agent's context would hold several tasks.

A prompt plus its new tokens must fit the target's positions (SmolLM2: max_position_embeddings 8192), so a length
above max_position_embeddings - max_new_tokens is cut to it (8192 -> 8128 with 64 new tokens); the table shows the
length used, the JSON both.

Per length:
- tau: greedy decoding (drafters.decoding.spec_decode) by the drafter and by prompt lookup (B - 1 drafted tokens,
  B the drafter's block size), pooled over the prompts (tokens committed / verify steps); both outputs are
  compared with the target's own greedy output token for token, and the prompts that differ are counted.
- cost, on the first prompt: one `DFlashDrafter.step` with the drafter's cache holding L context positions
  (L - 1 in the cache, plus the prompt's last token added by the step, as a decode step adds the tokens accepted
  since the last one); the whole proposal (the step plus the
  target's vocabulary projection of the block, `DFlashProposer.propose`); and the target's verify pass of the
  block [anchor, drafts] over its KV cache of L positions, with the feature capture a DFlash decode runs. Each is
  the median of --repeats calls after --warmup calls.
Ratios are to the shortest length; the triggers compare the longest with the shortest.

Writes long_context.json and long_context.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import numpy as np
import torch

DRAFTER = "drafter"
TAU_DROP_LIMIT = 0.10   # the trigger: tau at the longest length more than 10% below the shortest's
STEP_COST_LIMIT = 2.0   # the trigger: a draft step at the longest length over 2x the shortest's


def parse_windows(text: str) -> list[int | None]:
    return [None if part.strip().lower() in ("none", "full") else int(part) for part in text.split(",") if part.strip()]


def parse_lengths(text: str) -> list[int]:
    lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    if not lengths or lengths[0] < 2:
        raise argparse.ArgumentTypeError(f"lengths must be integers >= 2, got {text!r}")
    return lengths


def fitted_length(requested: int, max_positions: int | None, max_new_tokens: int) -> int:
    """The prompt length used: at most max_positions - max_new_tokens, so that the whole decode fits."""
    return requested if max_positions is None else min(requested, max_positions - max_new_tokens)


def session_requests(trajectories: str, vocab_size: int, quarantine_path: Path) -> list:
    """Every logged request as an eval Trace: sessions in log order, each session's requests in time order."""
    from eval.traces import agentic_traces

    everything = 10**9
    return agentic_traces(trajectories, vocab_size, max_prompts=everything, max_new_tokens=0,
                          per_session=everything, quarantine_path=quarantine_path).traces


def distinct_requests(requests: list) -> list:
    """The requests whose ids are not all repeated at the start of the same session's next request."""
    kept = []
    for request, following in zip(requests, requests[1:] + [None]):
        continued = (following is not None and following.meta["session_id"] == request.meta["session_id"]
                     and following.input_ids[: request.num_tokens] == request.input_ids)
        if not continued:
            kept.append(request)
    return kept


def closing_requests(pieces: list, count: int) -> list[int]:
    """Indexes in pieces of the `count` longest requests that close a session (others after them if too few)."""
    closes = [i == len(pieces) - 1 or pieces[i + 1].meta["session_id"] != p.meta["session_id"]
              for i, p in enumerate(pieces)]
    ranked = sorted(range(len(pieces)), key=lambda i: (not closes[i], -pieces[i].num_tokens, i))
    return ranked[:count]


def long_prompt(pieces: list, end: int, length: int) -> tuple[list[int], dict]:
    """Exactly `length` ids ending with pieces[end], preceded by the pieces before it in the log (wrapping)."""
    ids = list(pieces[end].input_ids)
    joined = [pieces[end].id]
    index = end
    while len(ids) < length:
        index = (index - 1) % len(pieces)
        if index == end:
            raise ValueError(f"the log holds {len(ids)} distinct request tokens around {pieces[end].id}, "
                             f"fewer than the {length} a prompt needs: simulate more sessions")
        ids = pieces[index].input_ids + ids
        joined.append(pieces[index].id)
    return ids[-length:], {"ends_with": pieces[end].id, "session_id": pieces[end].meta["session_id"],
                           "request_tokens": pieces[end].num_tokens, "joined_requests": joined[::-1]}


def median_ms(call, repeats: int, warmup: int, after=None) -> float:
    """Median wall time of call() in ms; after() runs between calls, untimed."""
    times = []
    for i in range(warmup + repeats):
        started = time.perf_counter()
        call()
        if i >= warmup:
            times.append(time.perf_counter() - started)
        if after is not None:
            after()
    return 1000 * statistics.median(times)


@torch.no_grad()
def step_costs(drafter, head, target, prompt_ids: list[int], repeats: int, warmup: int) -> dict:
    """Median ms of a draft step, a whole proposal and a verify pass, with L = len(prompt_ids) context positions."""
    from transformers import DynamicCache

    from drafters.decoding.proposers import DFlashProposer
    from drafters.decoding.spec_decode import TargetRunner
    from drafters.drafter.model import DraftCache
    from drafters.target.capture import crop_cache

    length = len(prompt_ids)
    runner = TargetRunner(target, list(drafter.target_layer_ids), head)
    try:
        target_cache = DynamicCache(config=target.config)
        prefill = runner.run(torch.tensor([prompt_ids]), target_cache, rows="last")
        anchor = int(prefill.logits[-1].argmax())
        features = prefill.features
        proposer = DFlashProposer(drafter, head)
        size = proposer.block_size
        block_ids = torch.full((1, size), drafter.mask_token_id, dtype=torch.long)
        block_ids[0, 0] = anchor
        block = head.embed(block_ids)
        filled = DraftCache()
        drafter.step(features[:, :-1], block, length - 1, filled)
        newest = features[:, -1:]
        context = np.array(prompt_ids + [anchor], dtype=np.int64)

        def propose():
            proposer.cache, proposer.pending = filled, newest
            return proposer.propose(context, size - 1, 0.0, None)

        def forget_newest():  # every repetition sees the same L - 1 cached positions
            filled.crop(length - 1)

        drafts = propose().drafts
        forget_newest()
        verify_ids = torch.tensor([[anchor] + drafts])
        positions = torch.arange(length, length + verify_ids.shape[1])[None]
        return {
            "draft_step_ms": median_ms(lambda: drafter.step(newest, block, length, filled), repeats, warmup,
                                       after=forget_newest),
            "proposal_ms": median_ms(propose, repeats, warmup, after=forget_newest),
            "verify_ms": median_ms(lambda: runner.run(verify_ids, target_cache, positions), repeats, warmup,
                                   after=lambda: crop_cache(target_cache, length)),
            "draft_cache_positions": filled.length + 1,
            "verify_block": verify_ids.shape[1],
        }
    finally:
        runner.close()


def decode_methods(drafter, head, target, prompt_ids: list[int], max_new_tokens: int, stop_ids, lookup_draft: int,
                   windows: list[int | None]) -> dict:
    """The target alone (the greedy truth), prompt lookup and the drafter under each window on one prompt."""
    from drafters.decoding.spec_decode import generate, lookup_generate, target_generate
    from eval.measures import LOOKUP, TARGET

    prompt = torch.tensor([prompt_ids])
    decoded = {TARGET: target_generate(target, prompt, max_new_tokens, stop_ids),
               LOOKUP: lookup_generate(target, prompt, max_new_tokens, stop_ids, num_draft=lookup_draft)}
    for window in windows:
        with windowed(drafter, window):
            decoded[drafter_name(window)] = generate(drafter, target, prompt, max_new_tokens, stop_ids, head=head)
    return decoded


def drafter_name(window: int | None) -> str:
    return DRAFTER if window is None else f"{DRAFTER}@{window}"


@contextlib.contextmanager
def windowed(drafter, window: int | None):
    """The same weights with another draft attention window (None: as the drafter was saved)."""
    saved = drafter.sliding_window
    drafter.sliding_window = window if window is not None else saved
    try:
        yield
    finally:
        drafter.sliding_window = saved


def pooled_tau(runs: list) -> float:
    steps = [s for run in runs for s in run.acceptance_lengths]
    return sum(steps) / max(len(steps), 1)


def measure_length(models: dict, pieces: list, ends: list[int], requested: int, length: int, args) -> list[dict]:
    """One row per draft attention window at this length (the target and prompt lookup decode once)."""
    from eval.measures import LOOKUP, TARGET, first_difference, mismatch

    names = [drafter_name(w) for w in args.windows]
    runs = {TARGET: [], LOOKUP: [], **{name: [] for name in names}}
    prompts, mismatches = [], []
    for end in ends:
        ids, meta = long_prompt(pieces, end, length)
        decoded = decode_methods(models["drafter"], models["head"], models["target"], ids, args.max_new_tokens,
                                 models["stop_ids"], models["lookup_draft"], args.windows)
        truth = decoded[TARGET].tokens
        for method, result in decoded.items():
            runs[method].append(result)
            diff = first_difference(truth, result.tokens)
            if method != TARGET and diff is not None:
                mismatches.append(mismatch(method, f"L{length}", meta["ends_with"], truth, result.tokens, diff))
        prompts.append({**meta, "new_tokens": len(truth), "lookup_tau": round(decoded[LOOKUP].tau, 4),
                        **{f"{name}_tau": round(decoded[name].tau, 4) for name in names},
                        **{f"{name}_acceptance": decoded[name].acceptance_lengths for name in names}})
        print(f"[L={length}] {meta['ends_with']}: {len(truth)} new tokens, lookup tau {decoded[LOOKUP].tau:.2f}, "
              + ", ".join(f"{name} tau {decoded[name].tau:.2f}" for name in names), flush=True)
    first_ids, _ = long_prompt(pieces, ends[0], length)
    target_steps = sum(len(r.acceptance_lengths) for r in runs[TARGET])
    rows = []
    for window, name in zip(args.windows, names):
        with windowed(models["drafter"], window):
            costs = step_costs(models["drafter"], models["head"], models["target"], first_ids, args.repeats, args.warmup)
        rows.append({"window": window, "requested_length": requested, "length": length,
                     "drafter_tau": round(pooled_tau(runs[name]), 4), "lookup_tau": round(pooled_tau(runs[LOOKUP]), 4),
                     "drafter_steps": sum(len(r.acceptance_lengths) for r in runs[name]),
                     "new_tokens": sum(len(r.tokens) for r in runs[TARGET]),
                     "drafter_mismatches": sum(m["method"] == name for m in mismatches),
                     "lookup_mismatches": sum(m["method"] == LOOKUP for m in mismatches),
                     "target_decode_ms_per_token": round(1000 * sum(r.decode_seconds for r in runs[TARGET])
                                                         / max(target_steps, 1), 3),
                     **{k: round(v, 3) if isinstance(v, float) else v for k, v in costs.items()},
                     "prompts": prompts, "mismatches": [m for m in mismatches if m["method"] in (name, LOOKUP)]})
        print(f"[L={length}] {name}: draft step {costs['draft_step_ms']:.2f} ms, proposal {costs['proposal_ms']:.2f} ms, "
              f"verify {costs['verify_ms']:.2f} ms", flush=True)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Each row's figures over the shortest length's under the same window."""
    for window in dict.fromkeys(r["window"] for r in rows):
        group = [r for r in rows if r["window"] == window]
        base = group[0]
        for row in group:
            for key in ("drafter_tau", "lookup_tau", "draft_step_ms", "proposal_ms", "verify_ms"):
                row[f"{key}_ratio"] = round(row[key] / base[key], 4) if base[key] else None


def triggers(rows: list[dict]) -> dict:
    """The issue's two conditions for a sliding window, longest length against shortest, per window."""
    fired = {}
    for window in dict.fromkeys(r["window"] for r in rows):
        group = [r for r in rows if r["window"] == window]
        short, long = group[0], group[-1]
        tau_drop = 1 - long["drafter_tau"] / short["drafter_tau"] if short["drafter_tau"] else None
        step_ratio = long["draft_step_ms_ratio"]
        fired[drafter_name(window)] = {
            "compared_lengths": [short["length"], long["length"]],
            "tau_drop": None if tau_drop is None else round(tau_drop, 4),
            "tau_trigger": tau_drop is not None and tau_drop > TAU_DROP_LIMIT,
            "draft_step_ratio": step_ratio,
            "cost_trigger": step_ratio is not None and step_ratio > STEP_COST_LIMIT}
    return fired


def cell(row: dict, key: str, digits: int = 3) -> str:
    """A figure and its ratio to the shortest length's."""
    ratio = row[f"{key}_ratio"]
    return f"{row[key]:.{digits}f} ({'-' if ratio is None else f'{ratio:.2f}'})"


def table(rows: list[dict], fired: dict) -> str:
    header = ("| window | length | drafter tau (x shortest) | lookup tau (x) | mismatches drafter / lookup "
              "| draft step ms (x) | proposal ms (x) | verify ms (x) | target ms/token |")
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['window'] or 'full'} | {r['length']} | {cell(r, 'drafter_tau')} | {cell(r, 'lookup_tau')} "
                     f"| {r['drafter_mismatches']} / {r['lookup_mismatches']} | {cell(r, 'draft_step_ms', 2)} "
                     f"| {cell(r, 'proposal_ms', 2)} | {cell(r, 'verify_ms', 2)} | {r['target_decode_ms_per_token']:.2f} |")
    lines.append("")
    for name, f in fired.items():
        short, long = f["compared_lengths"]
        drop = "-" if f["tau_drop"] is None else f"{f['tau_drop']:+.1%}"
        lines.append(f"- {name}, {long} against {short}: tau drop {drop} (trigger above {TAU_DROP_LIMIT:.0%}: "
                     f"{'FIRES' if f['tau_trigger'] else 'no'}); draft step x{f['draft_step_ratio']:.2f} (trigger above "
                     f"x{STEP_COST_LIMIT:g}: {'FIRES' if f['cost_trigger'] else 'no'}).")
    return "\n".join(lines) + "\n"


def load_models(drafter_arg: str, target_arg: str | None, dtype: torch.dtype) -> tuple[dict, object, dict]:
    """(models, the target's config, the drafter's description); the drafter is checked against the target first."""
    from drafters.target.frozen import FrozenTargetHead
    from drafters.target.loading import (
        load_target_config,
        load_target_model,
        load_target_tokenizer,
    )
    from drafters.target.testbed import prepare_testbed_target
    from engines.hf.generation import stop_token_ids
    from eval.inputs import check_finite, check_fit, load_spec, resolve_drafter

    target_path = Path(target_arg) if target_arg else prepare_testbed_target()
    target_config = load_target_config(target_path)
    spec = resolve_drafter(drafter_arg)
    check_fit(spec, target_config, str(target_path))
    check_finite(spec)
    target = load_target_model(target_path, dtype=dtype)
    head = FrozenTargetHead.from_model(target)
    drafter = load_spec(spec, dtype, target_config)
    models = {"target": target, "head": head, "drafter": drafter, "lookup_draft": drafter.block_size - 1,
              "stop_ids": stop_token_ids(target, load_target_tokenizer(target_path))}
    return models, target_config, {**spec.describe(), "target_path": str(target_path)}


def main(argv=None) -> None:
    from common.atomic_files import write_json_atomic
    from common.dtypes import TORCH_DTYPES
    from drafters.drafter.config import text_config
    from eval.acceptance import choose_threads

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="reference-format folder, checkpoint or training output_dir")
    parser.add_argument("--trajectories", required=True, help="agent sessions (dflash-pipeline simulate's folder or log)")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed target)")
    parser.add_argument("--lengths", type=parse_lengths, default=parse_lengths("1024,2048,4096,8192"))
    parser.add_argument("--prompts", type=int, default=4, help="prompts per length")
    parser.add_argument("--windows", type=parse_windows, default=[None],
                        help="draft attention windows to compare, e.g. none,1024 (none: as the drafter was saved)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per cost (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="fp32 for the exactness check")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the idle cores)")
    parser.add_argument("--out", default="outputs/bench/long_context")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(choose_threads(args.threads))
    models, target_config, described = load_models(args.drafter, args.target, TORCH_DTYPES[args.dtype])
    text = text_config(target_config)
    max_positions = getattr(text, "max_position_embeddings", None)
    pieces = distinct_requests(session_requests(args.trajectories, int(text.vocab_size), out / "agentic_quarantine.jsonl"))
    ends = closing_requests(pieces, args.prompts)
    print(f"[long-context] {len(pieces)} distinct requests ({sum(p.num_tokens for p in pieces)} tokens); prompts end "
          f"with {[pieces[i].id for i in ends]}; {torch.get_num_threads()} threads", flush=True)
    started = time.perf_counter()
    rows = [row for requested in args.lengths
            for row in measure_length(models, pieces, ends, requested,
                                      fitted_length(requested, max_positions, args.max_new_tokens), args)]
    rows.sort(key=lambda r: (r["window"] is not None, r["window"] or 0, r["length"]))
    add_ratios(rows)
    fired = triggers(rows)
    markdown = table(rows, fired)
    report = {"settings": {**vars(args), "threads": torch.get_num_threads(),
                           "max_position_embeddings": max_positions, "lookup_num_draft": models["lookup_draft"],
                           "wall_seconds": round(time.perf_counter() - started, 1)},
              "drafter": described, "triggers": fired, "lengths": rows}
    write_json_atomic(out / "long_context.json", report)
    (out / "long_context.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / 'long_context.json'} and {out / 'long_context.md'}")


if __name__ == "__main__":
    main()
