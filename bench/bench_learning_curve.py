"""Learning curve: held-out acceptance length against the wall minutes a recipe has spent.

Every training run with `train.snapshot_every: N` keeps a serving-format drafter every N steps under
`<output_dir>/snapshots/step-NNNNNN/`, with the wall time the run had spent by then (data regeneration
and feature capture included when the run did them: `elapsed_seconds` in its trainer_state.json). This
script scores every snapshot of one or more runs on the eval's held-out code, prose and chat prompts (or the
categories of `--categories`: writing too, and agentic from the held-out sessions of `--trajectories`),
teacher forced: the target (fp32, as in `eval.acceptance`) writes its greedy continuation once, every
snapshot drafts a block at every continuation position, and slot k counts while slots 1..k match. That
is the eval's `sim tau`, which tracks its decoded tau (BENCHMARKS.md).

    python -m bench.bench_learning_curve quick=outputs/testbed full=outputs/testbed-full --out outputs/bench/curve

Writes curve.json, curve.md (a table) and curve.png (tau against minutes, one line per run and
category). Scores are cached in curve.json, so a rerun scores only new snapshots or new categories, and the
target's continuations in continuations.pt, per category.
`--prep-minutes NAME=M` adds M minutes to a run whose data and features came from an earlier run's cache.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

CATEGORIES = ("code", "prose", "chat")


def snapshots(output_dir: Path) -> list[tuple[Path, dict]]:
    found = []
    for folder in sorted((output_dir / "snapshots").glob("step-*")):
        state = folder / "trainer_state.json"
        if state.exists() and (folder / "config.json").exists():
            found.append((folder, json.loads(state.read_text())))
    return found


def lookup_hits(sequence: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """[N] bool per continuation anchor a (as teacher_forced_slots orders them): prompt lookup's first
    drafted token after a is the target's next token. Splits slot-1 accuracy into copyable positions
    (the context already holds the answer) and the rest."""
    from drafters.decoding.proposers import ngram_lookup

    tokens = sequence[0].tolist()
    hits = []
    for a in range(n_prompt, len(tokens) - 1):
        proposal = ngram_lookup(tokens[: a + 1], num_draft=1)
        hits.append(bool(proposal) and proposal[0] == tokens[a + 1])
    return torch.tensor(hits, dtype=torch.bool)


def score(drafter, head, features_of, rows_of) -> dict:
    from eval.measures import teacher_forced_slots
    from drafters.drafter.objective import acceptance_stats

    out = {}
    with torch.inference_mode():
        for category, rows in rows_of.items():
            correct, valid, copyable = [], [], []
            for index, (sequence, n_prompt) in enumerate(rows):
                slots = teacher_forced_slots(drafter, head, features_of(category, index), sequence, n_prompt)
                if slots is not None:
                    correct.append(slots[0])
                    valid.append(slots[1])
                    copyable.append(lookup_hits(sequence, n_prompt))
            stats = acceptance_stats(torch.cat(correct), torch.cat(valid))
            slot1, copyable = torch.cat(correct)[:, 0], torch.cat(copyable)
            out[category] = {"sim_tau": round(stats["sim_tau"], 4), "slot1": round(stats["slot_accuracy"][0], 4),
                             "copyable_share": round(float(copyable.float().mean()), 4),
                             "slot1_copyable": round(float(slot1[copyable].float().mean()), 4) if copyable.any() else None,
                             "slot1_other": round(float(slot1[~copyable].float().mean()), 4) if (~copyable).any() else None}
    return out


def plot(results: dict, path: Path, categories=CATEGORIES) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(categories), figsize=(5 * len(categories), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, category in zip(axes, categories):
        for run, points in results.items():
            pts = sorted(points.values(), key=lambda p: p["minutes"])
            ax.plot([p["minutes"] for p in pts], [p["scores"][category]["sim_tau"] for p in pts], marker="o", label=run)
        ax.set_title(f"{category} (held out)")
        ax.set_xlabel("wall minutes spent (data + training)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance length tau (teacher forced)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def table(results: dict, categories=CATEGORIES) -> str:
    head = "| run | step | minutes | " + " | ".join(f"{c} tau | {c} slot-1" for c in categories) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(categories))]
    for run, points in results.items():
        for p in sorted(points.values(), key=lambda p: p["minutes"]):
            cells = " | ".join(f"{p['scores'][c]['sim_tau']:.3f} | {p['scores'][c]['slot1']:.3f}" for c in categories)
            lines.append(f"| {run} | {p['step']} | {p['minutes']:.1f} | {cells} |")
    split = [p for points in results.values() for p in points.values() if "slot1_copyable" in p["scores"][categories[0]]]
    if split:
        lines += ["", "Slot-1 accuracy where prompt lookup's first token is right (copyable: the context holds the "
                  "answer) and elsewhere (share of copyable positions in brackets):", "",
                  "| run | step | " + " | ".join(f"{c} copyable | {c} other" for c in categories) + " |",
                  "|" + "---|" * (2 + 2 * len(categories))]
        for run, points in results.items():
            for p in sorted(points.values(), key=lambda p: p["minutes"]):
                if "slot1_copyable" not in p["scores"][categories[0]]:
                    continue
                cells = " | ".join(f"{_fmt(p['scores'][c]['slot1_copyable'])} ({p['scores'][c]['copyable_share']:.2f}) | "
                                   f"{_fmt(p['scores'][c]['slot1_other'])}" for c in categories)
                lines.append(f"| {run} | {p['step']} | {cells} |")
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.bench_heldout_tau import continuations
    from common.atomic_files import write_json_atomic
    from drafters.target.capture import HFCapture
    from drafters.drafter.checkpoint import load_drafter
    from drafters.target.frozen import FrozenTargetHead
    from eval.inputs import parse_drafter_arg
    from configs.paths import default_cache_dir
    from eval.traces import CATEGORIES as TRACE_CATEGORIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="[NAME=]training output_dir with snapshots/")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed target)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per category")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prep-minutes", action="append", default=[], help="NAME=M: minutes of preparation the run reused")
    parser.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated: code, prose, chat, writing, agentic")
    parser.add_argument("--trajectories", action="append", default=[], help="held-out agent sessions (agentic)")
    parser.add_argument("--out", default="outputs/bench/curve")
    args = parser.parse_args(argv)
    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    unknown = sorted(set(categories) - set(TRACE_CATEGORIES))
    if unknown or not categories:
        parser.error(f"--categories: unknown {unknown}; choose from {TRACE_CATEGORIES}")
    if "agentic" in categories and not args.trajectories:
        parser.error("--categories agentic needs --trajectories (held-out agent sessions)")

    target = Path(args.target) if args.target else default_cache_dir() / "targets" / "SmolLM2-135M-Instruct"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prep = {name: float(m) for name, _, m in (a.partition("=") for a in args.prep_minutes)}
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    cache = out / "continuations.pt"
    key = {"target": str(target.resolve()), "prompts": args.prompts, "new_tokens": args.new_tokens}
    # Our own file of plain tensors and lists: weights_only keeps it from running code.
    traces = torch.load(cache, weights_only=True) if cache.exists() else None
    if traces is None or {k: traces["key"].get(k) for k in key} != key:
        traces = {"key": key, "categories": {}}
    if args.trajectories and traces.get("trajectories") != sorted(args.trajectories):
        traces["categories"].pop("agentic", None)  # other sessions: curve.json's agentic scores need a new --out
        traces["trajectories"] = sorted(args.trajectories)
    missing = [c for c in categories if c not in traces["categories"]]
    if missing:
        tokenizer = AutoTokenizer.from_pretrained(target)
        traces["categories"].update(continuations(model, tokenizer, args.prompts, args.new_tokens, missing,
                                                  args.trajectories))
        torch.save(traces, cache)
    rows_of = {c: traces["categories"][c] for c in categories}
    head = FrozenTargetHead.from_pretrained(target, dtype=torch.float32)
    captured: dict[tuple, dict] = {}

    def features_for(layer_ids):
        key = tuple(layer_ids)
        if key not in captured:
            capture = HFCapture(model, list(layer_ids))
            with torch.inference_mode():
                captured[key] = {(c, i): capture.capture(seq, with_final=False).selected
                                 for c, rows in rows_of.items() for i, (seq, _) in enumerate(rows)}
            capture.remove()
        return lambda category, index: captured[key][(category, index)]

    results_path = out / "curve.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for arg in args.runs:
        name, path = parse_drafter_arg(arg)
        points = results.setdefault(name, {})
        for folder, state in snapshots(Path(path)):
            minutes = state.get("elapsed_seconds", 0.0) / 60 + prep.get(name, 0.0)
            done = points.get(folder.name)
            if done and done["minutes"] == minutes and all(c in done["scores"] for c in categories):
                continue
            drafter = load_drafter(folder, dtype=torch.float32).eval()
            todo = {c: rows for c, rows in rows_of.items() if not done or c not in done["scores"] or done["minutes"] != minutes}
            scores = {**(done["scores"] if done and done["minutes"] == minutes else {}),
                      **score(drafter, head, features_for(drafter.target_layer_ids), todo)}
            points[folder.name] = {"step": state["step"], "minutes": minutes, "scores": scores}
            print(json.dumps({"run": name, "step": state["step"], "minutes": round(minutes, 2), **scores}), flush=True)
            write_json_atomic(results_path, results)
    shown = {run: {k: p for k, p in points.items() if all(c in p["scores"] for c in categories)}
             for run, points in results.items()}
    (out / "curve.md").write_text(table(shown, categories))
    plot(shown, out / "curve.png", categories)
    print(f"wrote {results_path}, {out / 'curve.md'}, {out / 'curve.png'}")


if __name__ == "__main__":
    main()
