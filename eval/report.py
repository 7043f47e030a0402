"""The evaluation report: report.json (everything), report.md (the table people read), PNG plots.

report.json (version 1), top-level keys:
  version, created, wall_seconds
  settings     every setting of the run, plus target_path, stop_ids, lookup_num_draft, torch_threads,
               cpu_count, load_average [start, end], device, torch
  target       path, num_hidden_layers, vocab_size, hidden_size, testbed
  drafters     [{name, path, folder, kind (reference | checkpoint | fp8), block_size, target_layer_ids,
                 mask_token_id, num_layers, stored_dtype, quantization}]
  methods      column order: the drafters' names, "<name>+lookup" (each drafter with prompt lookup, unless
               eval.with_lookup_min_match is null), "prompt_lookup", "target"
  block_sizes  {method: B} (prompt lookup: drafted tokens + 1; a drafter with lookup: the larger; target: 1)
  categories   {category (and "all" when there are several): {prompts, prompt_tokens, source, ids, ...,
                 methods: {method: {prompts, new_tokens, steps, tau_mean, tau_median, tau_prompt_mean,
                   slot_acceptance [k = 1..B-1], prefill_seconds, decode_seconds, total_seconds,
                   tokens_per_s, tokens_per_s_e2e, speedup, speedup_e2e,
                   identical, mismatched                          (T = 0, not for the target itself)
                   sim_tau, sim_slot_accuracy, sim_blocks         (drafters)
                   reference: {prompts, tau_ours, tau_reference, rel_diff, within_2pct,
                               acceptance_lengths_equal, outputs_identical_to_ours,
                               outputs_identical_to_target, reference_tokens_per_s}  (drafters)}}}}
  prompts      per prompt: {category, id, prompt_tokens, meta, results: {method: {new_tokens,
                 acceptance_lengths, tau, prefill_seconds, total_seconds, identical_to_target, first_diff,
                 sim_tau, reference: {...}, drafted_per_step (prompt lookup)}}}
  mismatches   [{method, category, prompt_id, first_diff, target_new_tokens, method_new_tokens,
                 target_tokens_at_diff, method_tokens_at_diff}]   (T = 0; "reference:<name>" for the
                 reference decoder)
  warnings, notes  lists of sentences
"""

from __future__ import annotations

import json
from pathlib import Path

from common.atomic_files import write_text_atomic
from drafters.decoding.proposers import COMBINATION_SERVING

PLOTS = ("tau_by_category.png", "slot_acceptance.png")
TESTBED_CALIBRATION = {"code": 1.43, "prose": 1.27}  # prompt lookup, z-lab decoder, 128 new tokens (facts)


def label(report: dict, method: str) -> str:
    if method == "target":
        return "target alone"
    if method == "prompt_lookup":
        return "prompt lookup"
    return method


def _short(text: str, limit: int = 32) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def _f(value, fmt: str = "{:.2f}", none: str = "–") -> str:
    return none if value is None else fmt.format(value)


def _cell(m: dict, method: str) -> str:
    if method == "target":
        return f"1.00 · 1.00x · {_f(m['tokens_per_s'], '{:.1f}')} tok/s"
    tau = f"**{_f(m['tau_mean'])}** / {_f(m['tau_median'], '{:g}')}"
    return f"{tau} · {_f(m['speedup'], '{:.2f}x')} · {_f(m['tokens_per_s'], '{:.1f}')} tok/s"


def markdown(report: dict) -> str:
    lines = _header(report)
    lines += _speed_section(report)
    lines += _serving_section(report)
    lines += _sim_section(report)
    lines += _reference_section(report)
    if report["settings"]["temperature"] <= 0:
        lines += _exactness_section(report)
    lines += ["## Plots", "", "![tau by category](tau_by_category.png)", "",
              "![per-slot acceptance](slot_acceptance.png)", "",
              "Per-slot acceptance: the fraction of verify steps that accepted at least k drafted tokens.", ""]
    lines += _notes_section(report)
    return "\n".join(lines)


def _header(report: dict) -> list[str]:
    s, cats = report["settings"], report["categories"]
    lines = ["# DFlash acceptance report", ""]
    mode = "greedy (T=0)" if s["temperature"] <= 0 else f"sampled (T={s['temperature']:g})"
    lines.append(f"Target `{report['target']['path']}` ({s['dtype']}) · {mode} · up to {s['max_new_tokens']} new tokens "
                 f"per prompt · " + ", ".join(f"{c}: {cats[c]['prompts']} prompts" for c in cats if c != "all")
                 + f" · {report['created']}")
    lines.append("")
    if report["drafters"]:
        lines.append("Drafters: " + "; ".join(
            f"`{d['name']}` ({d['kind']}, block {d['block_size']}, {d['num_layers']} layers, target layers "
            f"{d['target_layer_ids']}{', ' + d['quantization'] if d['quantization'] else ''})" for d in report["drafters"]))
        lines.append("")
    for w in report["warnings"]:
        lines += [f"> **WARNING:** {w}", ""]
    return lines


def _speed_section(report: dict) -> list[str]:
    methods = report["methods"]
    lines = ["## Acceptance length and speed", ""]
    lines.append("| category | prompts | " + " | ".join(label(report, m) for m in methods) + " |")
    lines.append("|---|---:|" + "---|" * len(methods))
    for cat, c in report["categories"].items():
        cells = [_cell(c["methods"][m], m) for m in methods]
        lines.append(f"| {cat} | {c['prompts']} | " + " | ".join(cells) + " |")
    lines += ["", "Cell: **tau mean** / median (tokens committed per target verify step, bonus token included) · "
              "decode speedup over the target decoding alone on the same prompts · generated tokens/s "
              "(decode phase, prompt prefill excluded). The first token of every answer comes from the prefill "
              "and is not a step.", ""]
    return lines


def _serving_section(report: dict) -> list[str]:
    """Per category and drafter: the drafter, the drafter with lookup, or prompt lookup, by tau."""
    drafters = [d["name"] for d in report["drafters"]]
    combined = {d: f"{d}+lookup" for d in drafters if f"{d}+lookup" in report["methods"]}
    if not combined:
        return []
    lines = ["## What to serve", "", "| category | drafter | tau: drafter / with lookup / prompt lookup | serve |",
             "|---|---|---|---|"]
    for cat, c in report["categories"].items():
        for d, both in combined.items():
            taus = {d: c["methods"][d]["tau_mean"], both: c["methods"][both]["tau_mean"],
                    "prompt_lookup": c["methods"]["prompt_lookup"]["tau_mean"]}
            # Cheapest first, so a tie goes to the method with the fewest drafter passes.
            best = max(("prompt_lookup", d, both), key=lambda m: taus[m] or 0.0)
            cells = " / ".join(_f(taus[m]) for m in (d, both, "prompt_lookup"))
            lines.append(f"| {cat} | {d} | {cells} | {label(report, best)} |")
    lines += ["", "By tau, the tokens each target pass commits; a drafter pass costs more than a lookup, so where "
              "the drafter with lookup leads by a hair the speedup columns above decide. Which engine serves it: "
              + COMBINATION_SERVING, ""]
    return lines


def model_card_info(report: dict, drafter: str | None = None) -> dict:
    """The export's model card figures from an eval report: per category, tau of the drafter (the first one unless
    named), of the drafter with lookup and of prompt lookup."""
    names = [d["name"] for d in report["drafters"]]
    if not names or (drafter is not None and drafter not in names):
        raise ValueError(f"the eval report has drafters {names}, not {drafter!r}" if names else "the eval report has no drafter")
    drafter = drafter or names[0]
    columns = {"tau": drafter, "with_lookup": f"{drafter}+lookup", "prompt_lookup": "prompt_lookup"}
    info = {"target": report["target"]["path"]}
    for key, method in columns.items():
        taus = {c: s["methods"][method]["tau_mean"] for c, s in report["categories"].items()
                if c != "all" and method in s["methods"] and s["methods"][method]["tau_mean"] is not None}
        if taus:
            info[key] = taus
    return info


def _sim_section(report: dict) -> list[str]:
    drafters, cats = [d["name"] for d in report["drafters"]], report["categories"]
    if not (drafters and any("sim_tau" in c["methods"][d] for c in cats.values() for d in drafters)):
        return []
    lines = ["## Cheap estimate vs real decoding", "",
             "Simulated tau: teacher forcing on the target's own continuations (blocks anchored at every "
             "position, `drafters.drafter.objective.acceptance_stats`) vs tau measured by decoding.", ""]
    lines.append("| category | " + " | ".join(f"{d} (sim / real)" for d in drafters) + " |")
    lines.append("|---|" + "---|" * len(drafters))
    for cat, c in cats.items():
        cells = [f"{_f(c['methods'][d].get('sim_tau'))} / {_f(c['methods'][d]['tau_mean'])}" for d in drafters]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return lines + [""]


def _reference_section(report: dict) -> list[str]:
    drafters, greedy = [d["name"] for d in report["drafters"]], report["settings"]["temperature"] <= 0
    refs = [(cat, d, c["methods"][d]["reference"]) for cat, c in report["categories"].items() for d in drafters
            if c["methods"][d].get("reference")]
    if not refs:
        return []
    lines = ["## Reference cross-check (z-lab `dflash_generate`, same checkpoint and target)", ""]
    head = "| category | drafter | prompts | tau ours | tau reference | diff | acceptance lengths equal |"
    lines.append(head + (" outputs identical (ours / target) |" if greedy else ""))
    lines.append("|---|---|---:|---:|---:|---:|---:|" + ("---:|" if greedy else ""))
    for cat, d, r in refs:
        row = (f"| {cat} | {d} | {r['prompts']} | {_f(r['tau_ours'], '{:.3f}')} | {_f(r['tau_reference'], '{:.3f}')} | "
               f"{_f(None if r['rel_diff'] is None else 100 * r['rel_diff'], '{:+.2f}%')} | "
               f"{r['acceptance_lengths_equal']}/{r['prompts']} |")
        if greedy:
            row += f" {r['outputs_identical_to_ours']}/{r['prompts']} / {r['outputs_identical_to_target']}/{r['prompts']} |"
        lines.append(row)
    return lines + ["", "Goal: tau within 2% of the reference; at T=0 the same outputs and acceptance lengths.", ""]


def _exactness_section(report: dict) -> list[str]:
    lines = ["## Exactness at T=0", ""]
    checked = [m for m in report["methods"] if m != "target"]
    per_cat = {cat: c for cat, c in report["categories"].items() if cat != "all"}
    total = sum(per_cat[c]["methods"][m]["prompts"] for c in per_cat for m in checked)
    if not report["mismatches"]:
        lines.append(f"All {total} outputs ({', '.join(label(report, m) for m in checked)}; every prompt) and every "
                     "reference decode are identical to the target's own greedy output, token for token.")
    else:
        lines.append(f"**{len(report['mismatches'])} output(s) differ from the target's greedy output:**")
        lines += ["", "| method | category | prompt | first differing new token | new tokens (method / target) |",
                  "|---|---|---|---:|---:|"]
        for m in report["mismatches"]:
            lines.append(f"| {m['method']} | {m['category']} | `{m['prompt_id']}` | {m['first_diff']} | "
                         f"{m['method_new_tokens']} / {m['target_new_tokens']} |")
    return lines + [""]


def _notes_section(report: dict) -> list[str]:
    s, cats = report["settings"], report["categories"]
    lines = ["## Notes", ""]
    notes = list(report["notes"])
    notes.append("Speedup = decode tokens/s of the method / decode tokens/s of the target alone, each summed over the "
                 "category's prompts; prefill is timed separately for every method (end-to-end figures, prefill "
                 "included, are in report.json as tokens_per_s_e2e / speedup_e2e). Methods run interleaved per prompt.")
    notes.append(f"Prompt lookup: last n tokens (n = {s['lookup_max_ngram']} down to {s['lookup_min_ngram']}) matched at "
                 f"their earliest earlier occurrence in the context, up to {s['lookup_num_draft']} following tokens "
                 "drafted, verified by the target like a drafter.")
    if report["target"].get("testbed"):
        measured = ", ".join(f"{c} {_f(cats[c]['methods']['prompt_lookup']['tau_mean'])}"
                             for c in TESTBED_CALIBRATION if c in cats)
        notes.append("Testbed calibration (SmolLM2-135M-Instruct, 128 new tokens, greedy, its own prompt set): prompt "
                     f"lookup tau {TESTBED_CALIBRATION['code']} on code and {TESTBED_CALIBRATION['prose']} on prose, a "
                     "random drafter 1.00" + (f"; this run's prompt lookup: {measured}" if measured else "") +
                     ". Prompt lookup depends strongly on the prompts (excerpts the target quotes, greedy repetition "
                     "loops), so the bar a drafter has to beat is this report's prompt-lookup column on the same prompts.")
    if s["temperature"] > 0:
        notes.append("T>0: outputs are samples, so they are not compared token for token; rejection sampling keeps "
                     "them distributed as the target's own samples. Sim tau stays a greedy-match estimate.")
    lines += [f"- {n}" for n in notes]
    lines.append("")
    return lines


def _methods_for_plot(report: dict) -> list[str]:
    return list(report["methods"])


def plot_tau(report: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    cats = [c for c in report["categories"]]
    methods = _methods_for_plot(report)
    fig = Figure(figsize=(max(6.0, 1.6 * len(cats) * max(1, len(methods)) / 2), 4.2), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        values = [report["categories"][c]["methods"][m]["tau_mean"] or 0.0 for c in cats]
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(cats))]
        bars = ax.bar(xs, values, width, label=_short(label(report, m)))
        for bar, v in zip(bars, values):
            ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("acceptance length tau (tokens / verify step)")
    ax.set_title("Acceptance length by category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def plot_slots(report: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    cats = [c for c in report["categories"] if c != "all"]
    methods = [m for m in report["methods"] if m != "target"]
    fig = Figure(figsize=(4.2 * len(cats), 3.8), dpi=110)
    for i, cat in enumerate(cats):
        ax = fig.add_subplot(1, len(cats), i + 1)
        for m in methods:
            curve = report["categories"][cat]["methods"][m]["slot_acceptance"]
            if curve:
                ax.plot(range(1, len(curve) + 1), curve, marker="o", markersize=3, label=_short(label(report, m)))
        ax.set_ylim(0, 1)
        ax.set_xlabel("k (drafted tokens)")
        if i == 0:
            ax.set_ylabel("fraction of steps accepting >= k")
        ax.set_title(cat)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md",
             "tau_plot": out_dir / PLOTS[0], "slot_plot": out_dir / PLOTS[1]}
    write_text_atomic(paths["json"], json.dumps(report, indent=2, default=str) + "\n")
    plot_tau(report, paths["tau_plot"])
    plot_slots(report, paths["slot_plot"])
    write_text_atomic(paths["md"], markdown(report))
    return paths


def console_summary(report: dict) -> str:
    methods = report["methods"]
    width = max(14, *(len(_short(label(report, m), 24)) for m in methods))
    lines = ["category  " + "".join(f"{_short(label(report, m), 24):>{width + 2}}" for m in methods)]
    for cat, c in report["categories"].items():
        cells = []
        for m in methods:
            s = c["methods"][m]
            cells.append(f"{_f(s['tau_mean'])} {_f(s['speedup'], '{:.2f}x')}")
        lines.append(f"{cat:<10}" + "".join(f"{cell:>{width + 2}}" for cell in cells))
    return "tau mean, decode speedup vs target alone\n" + "\n".join(lines)


def log_wandb(report: dict, out_dir: str | Path, project: str, mode: str) -> None:
    """Summary metrics and the plots to wandb (only when asked for: --wandb)."""
    try:
        import wandb
    except ImportError as err:
        raise RuntimeError("--wandb needs the wandb package: pip install 'dflash-pipeline[wandb]'") from err
    out_dir = Path(out_dir)
    metrics = {}
    for cat, c in report["categories"].items():
        for method, m in c["methods"].items():
            for key in ("tau_mean", "tau_median", "tokens_per_s", "speedup", "sim_tau"):
                if isinstance(m.get(key), (int, float)):
                    metrics[f"eval/{cat}/{method}/{key}"] = m[key]
            ref = m.get("reference") or {}
            if isinstance(ref.get("rel_diff"), (int, float)):
                metrics[f"eval/{cat}/{method}/reference_rel_diff"] = ref["rel_diff"]
    run = wandb.init(project=project, mode=mode, dir=str(out_dir), job_type="eval", config=report["settings"])
    run.log({**metrics, **{f"eval/{p[:-4]}": wandb.Image(str(out_dir / p)) for p in PLOTS}})
    run.summary.update(metrics)
    run.finish()
