"""Acceptance length (tau) and speed of DFlash drafters by real speculative decoding against the target.

    dflash-pipeline eval --drafter CKPT [--drafter name=CKPT2 ...] [--target PATH]
        [--traces code,prose,agentic] [--trajectories FILE_OR_DIR] [--max-prompts N] [--max-new-tokens N]
        [--max-tokens N] [--temperature T] [--reference-subset N] [--out DIR]
        [--config YAML] [section.key=value ...]

Settings are the config's eval section (``configs.schema.EvalConfig``; the flags set the same keys), the
target its target section. Drafters are resolved and checked by ``eval.inputs`` (any drafter path:
a folder, a checkpoint, an output_dir, an FP8 export; named by its path, or ``name=path``).

Per prompt, in this order (interleaved, so machine-load drift hits every method alike): the target
decoding alone (the baseline and, at T = 0, the ground truth), prompt-lookup drafting, every drafter
(all three through ``drafters.decoding.spec_decode.decode``), the teacher-forced estimate, and on the first
``reference_subset`` prompts of each category the z-lab reference decoder with the same checkpoints. At
T = 0 every output is compared with the target's own greedy output token for token; a mismatch is reported
(count and first differing position per prompt) and warned about loudly, never fatal. See eval/README.md
for the report.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from common.dtypes import TORCH_DTYPES
from configs.schema import PipelineConfig
from drafters.decoding.proposers import PromptLookup
from drafters.decoding.spec_decode import (
    Decoded,
    generate,
    lookup_generate,
    target_generate,
)
from drafters.drafter.objective import acceptance_stats
from drafters.target.capture import HFCapture
from drafters.target.frozen import FrozenTargetHead
from drafters.target.loading import load_target_model
from engines.hf.generation import stop_token_ids
from eval import report as report_mod
from eval.inputs import DrafterSpec, EvalError, load_spec, prepare, report_dir
from eval.measures import (
    LOOKUP,
    TARGET,
    first_difference,
    mismatch,
    summarize_category,
    teacher_forced_slots,
)
from eval.reference import load_reference_model, reference_generate
from eval.traces import TraceSet

REPORT_VERSION = 1


def _seed(base: int, *parts: int) -> int:
    value = base
    for p in parts:
        value = (value * 1_000_003 + p) % (2**62)
    return value


# --------------------------------------------------------------------------------------------------
# The evaluation, phase by phase
# --------------------------------------------------------------------------------------------------


@dataclass
class Models:
    target: torch.nn.Module
    head: object                     # FrozenTargetHead
    drafters: dict                   # name -> DFlashDrafter
    references: dict                 # name -> z-lab DFlashDraftModel (reference_subset > 0)
    stop_ids: list[int]
    methods: list[str]               # report column order: drafters, drafters with lookup, prompt lookup, target
    block_sizes: dict[str, int]
    lookup_draft: int


@dataclass
class Collected:
    prompts: list[dict] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)
    runs: dict = field(default_factory=dict)       # category -> method -> [Decoded]
    sim_slots: dict = field(default_factory=dict)  # category -> drafter -> [(slot_correct, slot_valid)]
    ref_rows: dict = field(default_factory=dict)   # category -> drafter -> [(ours, theirs, comparison)]


def evaluate(drafter_args: list[str], config: PipelineConfig, log=print, notes: list[str] | None = None) -> dict:
    """Run the whole evaluation (config.eval, on config.target) and write report.json, report.md and the plots
    under report_dir(config). Returns the report (the content of report.json). Raises EvalError / TraceError
    (ValueError) on input it refuses, before loading any weights."""
    specs, target_path, target_config, tokenizer, trace_sets, prep_notes = prepare(drafter_args, config, log)
    notes = list(notes or []) + prep_notes
    threads_before = torch.get_num_threads()
    torch.set_num_threads(choose_threads(config.eval.threads))
    try:
        load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        log(f"[eval] target {target_path} ({config.eval.dtype}); drafters: {[s.name for s in specs] or 'none'}; "
            + ", ".join(f"{c}: {len(ts.traces)} prompts" for c, ts in trace_sets.items()))
        report_dir(config).mkdir(parents=True, exist_ok=True)
        models = load_models(specs, target_path, target_config, tokenizer, config)
        if config.eval.warmup:
            warm_up(models, trace_sets)
        started = time.perf_counter()
        collected = decode_all(specs, models, trace_sets, config)
        wall = time.perf_counter() - started
        report = assemble_report(specs, models, trace_sets, collected, config, target_path, notes, wall, load_start)
    finally:
        torch.set_num_threads(threads_before)
    write_outputs(report, config, log)
    return report


def choose_threads(requested: int | None) -> int:
    """Requested threads, else torch's default minus the cores other processes keep busy (load average):
    OpenMP threads that share a core with another busy process slow a forward pass down ~10x here."""
    default = torch.get_num_threads()
    if requested:
        return requested
    if not hasattr(os, "getloadavg"):
        return default
    busy = int(round(os.getloadavg()[0]))
    return max(1, min(default, (os.cpu_count() or default) - busy))


def load_models(specs: list[DrafterSpec], target_path: Path, target_config, tokenizer, config: PipelineConfig) -> Models:
    ev = config.eval
    dtype = TORCH_DTYPES[ev.dtype]
    device_map = config.target.device_map
    target = load_target_model(target_path, dtype=dtype, device_map=device_map,
                               trust_remote_code=config.target.trust_remote_code,
                               offload_folder=report_dir(config) / "offload")
    if device_map is None:
        head = FrozenTargetHead.from_model(target)
    else:  # a dispatched target's embedding or head may live on another device or on disk: read them once
        device = target.get_input_embeddings().weight.device
        device = torch.device("cpu") if device.type == "meta" else device
        head = FrozenTargetHead.from_pretrained(target_path, dtype=dtype, device=device)
    drafters = {s.name: load_spec(s, dtype, target_config).to(head.embed_tokens.weight.device) for s in specs}
    references = {}
    if ev.reference_subset > 0:
        references = {s.name: load_reference_model(s.folder, dtype, fp8=s.kind == "fp8", ours=drafters[s.name])
                      for s in specs}
    lookup_draft = ev.lookup_num_draft
    if lookup_draft is None:
        lookup_draft = (specs[0].block_size - 1) if specs else 15
    combined = [with_lookup(s.name) for s in specs] if ev.with_lookup_min_match is not None else []
    block_sizes = {**{s.name: drafters[s.name].block_size for s in specs},
                   **{with_lookup(s.name): max(drafters[s.name].block_size, lookup_draft + 1) for s in specs},
                   LOOKUP: lookup_draft + 1, TARGET: 1}
    return Models(target, head, drafters, references, stop_token_ids(target, tokenizer),
                  [s.name for s in specs] + combined + [LOOKUP, TARGET], block_sizes, lookup_draft)


def with_lookup(drafter_name: str) -> str:
    """The report's name of a drafter decoding with prompt lookup (``DrafterWithLookup``)."""
    return f"{drafter_name}+lookup"


def warm_up(models: Models, trace_sets: dict[str, TraceSet]) -> None:
    """First-call allocations must not land in the first prompt's timings."""
    first = next(iter(trace_sets.values())).traces[0]
    ids = torch.tensor([first.input_ids[-32:]])
    target_generate(models.target, ids, 3, None, 0.0)
    for drafter in models.drafters.values():
        generate(drafter, models.target, ids, 3, None, 0.0, head=models.head)


def decode_all(specs, models: Models, trace_sets: dict[str, TraceSet], config: PipelineConfig) -> Collected:
    greedy = config.eval.temperature <= 0
    collected = Collected(runs={c: {m: [] for m in models.methods} for c in trace_sets},
                          sim_slots={c: {s.name: [] for s in specs} for c in trace_sets},
                          ref_rows={c: {s.name: [] for s in specs} for c in trace_sets})
    progress = tqdm(total=sum(len(ts.traces) for ts in trace_sets.values()), desc="eval", unit="prompt", file=sys.stderr)
    for c_index, (category, ts) in enumerate(trace_sets.items()):
        for p_index, trace in enumerate(ts.traces):
            results = decode_prompt(models, trace.input_ids, config, seed=_seed(config.eval.seed, c_index, p_index))
            row = record_prompt(collected, category, trace, results, models.methods, greedy)
            if config.eval.simulate and specs and len(results[TARGET].tokens) >= 2:
                simulate_prompt(collected, models, category, trace, results[TARGET].tokens, row)
            if p_index < config.eval.reference_subset:
                for spec in specs:
                    cross_check_reference(collected, models, spec.name, category, trace, results, row, config,
                                          seed=_seed(config.eval.seed, c_index, p_index, 99))
            collected.prompts.append(row)
            progress.set_postfix_str(f"{category} " + " ".join(f"{m[:12]}={results[m].tau:.2f}" for m in models.methods
                                                               if m != TARGET and results[m].acceptance_lengths))
            progress.update(1)
    progress.close()
    return collected


def decode_prompt(models: Models, input_ids: list[int], config: PipelineConfig, seed: int) -> dict[str, Decoded]:
    """Every method on one prompt: the target alone, prompt lookup, each drafter alone and with lookup (each its
    own seeded RNG)."""
    ev = config.eval
    ids = torch.tensor([input_ids], dtype=torch.long)
    gen = lambda m: torch.Generator().manual_seed(_seed(seed, m))  # noqa: E731
    results = {TARGET: target_generate(models.target, ids, ev.max_new_tokens, models.stop_ids, ev.temperature,
                                       generator=gen(0)),
               LOOKUP: lookup_generate(models.target, ids, ev.max_new_tokens, models.stop_ids, ev.temperature,
                                       num_draft=models.lookup_draft, max_ngram=ev.lookup_max_ngram,
                                       min_ngram=ev.lookup_min_ngram, generator=gen(1))}
    lookup = PromptLookup(models.lookup_draft, ev.lookup_max_ngram, ev.lookup_min_ngram)
    for m_index, (name, drafter) in enumerate(models.drafters.items()):
        results[name] = generate(drafter, models.target, ids, ev.max_new_tokens, models.stop_ids, ev.temperature,
                                 head=models.head, generator=gen(2 + m_index))
        if ev.with_lookup_min_match is not None:
            results[with_lookup(name)] = generate(
                drafter, models.target, ids, ev.max_new_tokens, models.stop_ids, ev.temperature, head=models.head,
                generator=gen(1000 + m_index), lookup=lookup, min_match=ev.with_lookup_min_match)
    return results


def record_prompt(collected: Collected, category: str, trace, results: dict[str, Decoded], methods: list[str],
                  greedy: bool) -> dict:
    """The prompt's row of the report; its runs and T = 0 mismatches go to collected."""
    truth = results[TARGET].tokens
    row = {"category": category, "id": trace.id, "prompt_tokens": trace.num_tokens, "meta": trace.meta, "results": {}}
    for method in methods:
        r = results[method]
        collected.runs[category][method].append(r)
        entry = {"new_tokens": len(r.tokens), "acceptance_lengths": r.acceptance_lengths,
                 "tau": r.tau if r.acceptance_lengths else None, "prefill_seconds": r.prefill_seconds,
                 "total_seconds": r.total_seconds}
        if method == LOOKUP:
            entry["drafted_per_step"] = r.proposed
        if method == TARGET:  # the ground truth a serving engine's output is held to (eval/engine.py)
            entry["output_ids"] = r.tokens
        if greedy and method != TARGET:
            diff = first_difference(r.tokens, truth)
            entry["identical_to_target"] = diff is None
            entry["first_diff"] = diff
            if diff is not None:
                collected.mismatches.append(mismatch(method, category, trace.id, truth, r.tokens, diff))
        row["results"][method] = entry
    return row


def simulate_prompt(collected: Collected, models: Models, category: str, trace, truth: list[int], row: dict) -> None:
    """The teacher-forced estimate of every drafter on the target's own continuation (one target pass)."""
    sequence = torch.tensor([trace.input_ids + truth], dtype=torch.long)
    union_ids = sorted({i for d in models.drafters.values() for i in d.target_layer_ids})
    hidden = models.head.hidden_size
    capture = HFCapture(models.target, union_ids)
    try:
        selected = capture.capture(sequence, with_final=False).selected
    finally:
        capture.remove()
    for name, drafter in models.drafters.items():
        cols = [union_ids.index(i) for i in drafter.target_layer_ids]
        features = torch.cat([selected[..., j * hidden:(j + 1) * hidden] for j in cols], dim=-1)
        slots = teacher_forced_slots(drafter, models.head, features, sequence, trace.num_tokens)
        if slots is not None:
            collected.sim_slots[category][name].append(slots)
            row["results"][name]["sim_tau"] = acceptance_stats(*slots)["sim_tau"]


def cross_check_reference(collected: Collected, models: Models, name: str, category: str, trace,
                          results: dict[str, Decoded], row: dict, config: PipelineConfig, seed: int) -> None:
    """z-lab's decoder with the same checkpoint on the same prompt, compared with ours (and the target's)."""
    ev = config.eval
    truth = results[TARGET].tokens
    ids = torch.tensor([trace.input_ids], dtype=torch.long)
    theirs = reference_generate(models.references[name], models.target, ids, ev.max_new_tokens, models.stop_ids,
                                ev.temperature, seed=seed)
    ours = results[name]
    ref = {"tau": theirs.tau if theirs.acceptance_lengths else None,
           "acceptance_lengths": theirs.acceptance_lengths, "new_tokens": len(theirs.tokens),
           "prefill_seconds": theirs.prefill_seconds, "total_seconds": theirs.total_seconds,
           "acceptance_lengths_equal": theirs.acceptance_lengths == ours.acceptance_lengths}
    if ev.temperature <= 0:
        ref["identical_to_ours"] = theirs.tokens == ours.tokens
        ref["identical_to_target"] = theirs.tokens == truth
        diff = first_difference(theirs.tokens, truth)
        if diff is not None:
            collected.mismatches.append(mismatch(f"reference:{name}", category, trace.id, truth, theirs.tokens, diff))
    row["results"][name]["reference"] = ref
    collected.ref_rows[category][name].append((ours, theirs, ref))


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


def summarize_categories(trace_sets: dict[str, TraceSet], collected: Collected, models: Models, greedy: bool) -> dict:
    categories = {}
    for category, ts in trace_sets.items():
        categories[category] = {**ts.describe(), "methods": summarize_category(
            collected.runs[category], collected.sim_slots[category], collected.ref_rows[category],
            models.block_sizes, greedy)}
    if len(trace_sets) > 1:
        def merged(per_category: dict) -> dict:
            keys = next(iter(per_category.values()))
            return {k: [x for c in trace_sets for x in per_category[c][k]] for k in keys}

        categories["all"] = {"category": "all", "prompts": sum(len(ts.traces) for ts in trace_sets.values()),
                             "prompt_tokens": sum(ts.prompt_tokens for ts in trace_sets.values()),
                             "methods": summarize_category(merged(collected.runs), merged(collected.sim_slots),
                                                           merged(collected.ref_rows), models.block_sizes, greedy)}
    return categories


def run_warnings(categories: dict, mismatches: list[dict], drafter_names: list[str], greedy: bool,
                 load_start: float | None, load_end: float | None) -> list[str]:
    warnings_: list[str] = []
    if greedy and mismatches:
        by_method: dict[str, int] = {}
        for m in mismatches:
            by_method[m["method"]] = by_method.get(m["method"], 0) + 1
        warnings_.append(
            "OUTPUT MISMATCH at T=0: " + ", ".join(f"{k}: {v} prompt(s)" for k, v in by_method.items())
            + " differ from the target's own greedy output (see 'mismatches': first differing position per prompt). "
            "Speculative decoding must reproduce the target exactly; with fp32 a rare near-tie flip between a "
            "batched verify pass and single-token decoding is numerics, anything systematic is a bug.")
    for category, cat in categories.items():
        for name in drafter_names:
            ref = cat["methods"][name].get("reference")
            if ref and ref["rel_diff"] is not None and abs(ref["rel_diff"]) > 0.02:
                warnings_.append(f"{category}/{name}: tau ours {ref['tau_ours']:.3f} vs reference "
                                 f"{ref['tau_reference']:.3f} differs by {100 * ref['rel_diff']:+.1f}% (goal within 2%)")
    cores = os.cpu_count() or 1
    if load_start is not None and max(load_start, load_end or 0) > cores:
        warnings_.append(f"machine load average {max(load_start, load_end or 0):.1f} on {cores} cores during the run: "
                         "tokens/s and speedups are noisy (tau is not affected)")
    return warnings_


def settings_record(config: PipelineConfig) -> dict:
    """Every setting of the run: the eval section and what it reads from the others."""
    return {"target": config.target.path, "cache_dir": config.cache_dir, **config.eval.model_dump(mode="json"),
            "out": str(report_dir(config)), "wandb_project": config.logging.wandb_project,
            "wandb_mode": config.logging.wandb_mode, "trust_remote_code": config.target.trust_remote_code,
            "thinking": config.data.thinking, "device_map": config.target.device_map}


def assemble_report(specs, models: Models, trace_sets, collected: Collected, config: PipelineConfig,
                    target_path: Path, notes: list[str], wall: float, load_start) -> dict:
    greedy = config.eval.temperature <= 0
    categories = summarize_categories(trace_sets, collected, models, greedy)
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    warnings_ = run_warnings(categories, collected.mismatches, [s.name for s in specs], greedy, load_start, load_end)
    for w in warnings_:
        print(f"[eval] WARNING: {w}", file=sys.stderr, flush=True)
    head = models.head
    settings = {**settings_record(config), "target_path": str(target_path), "stop_ids": models.stop_ids,
                "lookup_num_draft": models.lookup_draft, "torch_threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count() or 1, "load_average": [load_start, load_end],
                "device": str(head.embed_tokens.weight.device), "torch": torch.__version__}
    return {
        "version": REPORT_VERSION,
        "backend": "decoder (drafters.decoding.spec_decode on the HF target, in process)",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": wall,
        "settings": settings,
        "target": {"path": str(target_path), "num_hidden_layers": int(getattr(models.target.config, "num_hidden_layers", 0)),
                   "vocab_size": head.vocab_size, "hidden_size": head.hidden_size, "testbed": config.target.path is None},
        "drafters": [s.describe() for s in specs],
        "methods": models.methods,
        "block_sizes": models.block_sizes,
        "categories": categories,
        "prompts": collected.prompts,
        "mismatches": collected.mismatches,
        "warnings": warnings_,
        "notes": notes,
    }


def write_outputs(report: dict, config: PipelineConfig, log) -> None:
    out_dir = report_dir(config)
    report_mod.write_report(report, out_dir)
    if config.eval.wandb:
        report_mod.log_wandb(report, out_dir, config.logging.wandb_project, config.logging.wandb_mode)
    log(report_mod.console_summary(report))
    log(f"[eval] report: {out_dir / 'report.md'}")


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def eval_backend(flag: str | None, config: PipelineConfig) -> str:
    """--backend, else what the config's engine block serves with."""
    if flag is not None:
        return flag
    if config.target.backend == "sglang":
        raise EvalError("target.backend is sglang: SGLang is measured on its GPU server (dflash-pipeline sglang-check); "
                        "pass --backend decoder (the target in process) or --backend vllm")
    return "vllm" if config.target.backend == "vllm" else "decoder"
