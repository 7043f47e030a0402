"""Acceptance length (tau) and speed of DFlash drafters by real speculative decoding against the target.

    python -m eval.acceptance --drafter CKPT [--drafter name=CKPT2 ...] [--target PATH]
        [--traces code,prose,agentic] [--agentic-log FILE_OR_DIR] [--max-prompts N] [--max-new-tokens N]
        [--max-tokens N] [--temperature T] [--reference-subset N] [--out DIR]
        [--config YAML] [section.key=value ...]

A drafter is a reference-format folder (config.json + model.safetensors), a training checkpoint folder
holding ``drafter/``, a training output_dir (its newest ``checkpoints/step-*``), or an FP8 export
(config.json with "quantization_config"). It is named by its path, or ``name=path``. Every drafter is
checked against the target's config before anything is decoded (layer ids, mask id, vocabulary, hidden
size; both values named) and for finite weights.

Per prompt, in this order (interleaved, so machine-load drift hits every method alike): the target
decoding alone (the baseline and, at T = 0, the ground truth), prompt-lookup drafting, every drafter
(``drafters.spec_decode.generate``), the teacher-forced estimate, and on the first ``reference_subset``
prompts of each category the z-lab reference decoder with the same checkpoints. At T = 0 every output is
compared with the target's own greedy output token for token; a mismatch is reported (count and first
differing position per prompt) and warned about loudly, never fatal. See eval/README.md for the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.dtypes import TORCH_DTYPES
from drafters.checkpoint import find_drafter_folder, load_drafter
from drafters.spec_decode import Decoded, generate, lookup_generate, target_generate
from eval.traces import CATEGORIES, TraceError, TraceSet, agentic_traces, heldout_traces

TARGET = "target"
LOOKUP = "prompt_lookup"
RESERVED_NAMES = {TARGET, LOOKUP, "all"}
EVAL_DTYPES = ("bf16", "bfloat16", "float32", "fp32")  # names of TORCH_DTYPES that eval runs in
SIM_ANCHOR_CHUNK = 64  # anchors per teacher-forced forward (bounds the block attention's memory)
REPORT_VERSION = 1


class EvalError(ValueError):
    """Input the evaluation refuses before decoding anything (the message names the values)."""


# --------------------------------------------------------------------------------------------------
# Drafters: resolve, check against the target, load
# --------------------------------------------------------------------------------------------------


@dataclass
class DrafterSpec:
    name: str
    path: str            # as given on the command line
    folder: Path         # the reference-format (or FP8) folder that is loaded
    kind: str            # "reference" | "checkpoint" | "fp8"
    config: dict         # its config.json

    @property
    def block_size(self) -> int:
        return int((self.config.get("dflash_config") or {}).get("block_size", self.config.get("block_size", 16)))

    @property
    def target_layer_ids(self) -> list[int]:
        return list((self.config.get("dflash_config") or {}).get("target_layer_ids") or [])

    def describe(self) -> dict:
        dflash = self.config.get("dflash_config") or {}
        return {"name": self.name, "path": self.path, "folder": str(self.folder), "kind": self.kind,
                "block_size": self.block_size, "target_layer_ids": self.target_layer_ids,
                "mask_token_id": dflash.get("mask_token_id"), "num_layers": self.config.get("num_hidden_layers"),
                "stored_dtype": self.config.get("dtype") or self.config.get("torch_dtype"),
                "quantization": (self.config.get("quantization_config") or {}).get("quant_method")}


def parse_drafter_arg(arg: str) -> tuple[str, str]:
    """``name=path`` or ``path`` (named by its path)."""
    name, sep, path = arg.partition("=")
    if sep and name and "/" not in name and not Path(arg).exists():
        return name, path
    return arg, arg


def resolve_drafter(arg: str) -> DrafterSpec:
    name, given = parse_drafter_arg(arg)
    path = Path(given)
    try:
        folder = find_drafter_folder(path)
    except FileNotFoundError as err:
        raise EvalError(f"drafter {name!r}: {err}") from None
    kind = "reference" if folder == path else "checkpoint"
    config = json.loads((folder / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "fp8":
        kind = "fp8"
    elif config.get("quantization_config"):
        raise EvalError(f"drafter {name!r}: unsupported quantization_config {config['quantization_config']!r} "
                        "(only the block-FP8 exports of scripts/export.py are loaded)")
    return DrafterSpec(name, given, folder, kind, config)


def check_fit(spec: DrafterSpec, target_config, target_name: str) -> None:
    """Refuse a drafter that cannot run on this target, naming both values (before any decoding)."""
    from transformers import Qwen3Config

    from drafters.draft_config import text_config, validate_target

    raw = {k: v for k, v in spec.config.items() if k != "quantization_config"}
    target = text_config(target_config)
    where = f"drafter {spec.name!r} ({spec.folder}) does not fit the target {target_name}"
    draft_vocab = raw.get("vocab_size")
    if draft_vocab is not None and int(draft_vocab) != int(target.vocab_size):
        raise EvalError(f"{where}: drafter vocab_size {draft_vocab} != target vocab_size {target.vocab_size}")
    try:
        validate_target(Qwen3Config.from_dict(raw), target_config)
    except ValueError as err:
        raise EvalError(f"{where}: {err}") from None


def check_finite(spec: DrafterSpec) -> None:
    """Refuse a drafter with NaN / inf weights (a diverged training run): it would report tau 1.0 as if valid."""
    from safetensors import safe_open

    with safe_open(str(spec.folder / "model.safetensors"), framework="pt") as f:
        bad = [name for name in f.keys() if not torch.isfinite(f.get_tensor(name).float()).all()]
    if bad:
        raise EvalError(f"drafter {spec.name!r} ({spec.folder}) has non-finite weights in {len(bad)} tensor(s) "
                        f"({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}): a diverged training run; "
                        "no tau is reported for it")


def load_spec(spec: DrafterSpec, dtype: torch.dtype, target_config):
    from drafters.fp8 import load_fp8_drafter

    if spec.kind == "fp8":
        drafter = load_fp8_drafter(spec.folder, dtype=dtype)
    else:
        drafter = load_drafter(spec.folder, dtype=dtype, target_config=target_config)
    return drafter.eval().requires_grad_(False)


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


@dataclass
class EvalSettings:
    target: str | None = None              # None: the embedded testbed target (SmolLM2-135M-Instruct)
    cache_dir: str | None = None
    dtype: str = "float32"                 # target and drafters alike (the reference too)
    categories: list[str] = field(default_factory=lambda: ["code", "prose", "agentic"])
    agentic_log: list[str] = field(default_factory=list)
    agentic_per_session: int = 1
    max_prompts: int = 16                  # per category
    max_new_tokens: int = 128
    max_tokens: int | None = None          # per category: sum of (prompt tokens + max_new_tokens)
    temperature: float = 0.0
    reference_subset: int = 4              # first N prompts of each category
    seed: int = 0
    max_chars: int = 2000                  # held-out prompt size (characters of the user message)
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 1
    lookup_num_draft: int | None = None    # None: the first drafter's block size - 1 (15 without drafters)
    simulate: bool = True                  # teacher-forced estimate (sim tau)
    warmup: bool = True
    out: str = "outputs/eval"
    wandb: bool = False
    wandb_project: str = "dflash"
    wandb_mode: str = "offline"
    threads: int | None = None
    trust_remote_code: bool = False        # config target.trust_remote_code
    thinking: bool | None = None           # config data.thinking: the chat template's thinking switch
    # config target.device_map: shard the target in-process ("auto", or {module: device}; "disk" pages in).
    device_map: str | dict | None = None


# --------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing new token (the shorter length if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def teacher_forced_slots(drafter, head, features: torch.Tensor, sequence: torch.Tensor, n_prompt: int):
    """Blocks anchored at every position of the continuation (the target's own output), teacher forced.

    features [1, T, K*H] (the drafter's layers over the whole sequence); sequence [1, T] = prompt +
    continuation. Anchor a = n_prompt .. T-2 (the first generated token is the first anchor, as in
    decoding); slot k is right when the draft argmax equals the token at a + k. Returns (slot_correct,
    slot_valid), each [N, B-1], or None when the continuation has fewer than 2 tokens.
    """
    from drafters.objective import block_loss, block_targets, default_gamma

    seq_len = sequence.shape[1]
    if seq_len - 1 <= n_prompt:
        return None
    block = drafter.block_size
    loss_mask = torch.zeros_like(sequence, dtype=torch.bool)
    loss_mask[:, n_prompt:] = True
    corrects, valids = [], []
    for lo in range(n_prompt, seq_len - 1, SIM_ANCHOR_CHUNK):
        anchors = torch.arange(lo, min(lo + SIM_ANCHOR_CHUNK, seq_len - 1), device=sequence.device)[None]
        hidden = drafter.forward_train(features, sequence, anchors, head.embed)
        targets = block_targets(anchors, torch.ones_like(anchors, dtype=torch.bool), loss_mask, block)
        out = block_loss(hidden, targets, None, sequence, head.lm_head.weight, gamma=default_gamma(block), kind="ce")
        corrects.append(out.slot_correct[0])
        valids.append(out.slot_valid[0])
    return torch.cat(corrects), torch.cat(valids)


def summarize(runs: list[Decoded], target_runs: list[Decoded], block_size: int | None) -> dict:
    """Pooled metrics of one method on one category (and the same prompts' target-alone runs)."""
    steps = [s for r in runs for s in r.acceptance_lengths]
    decode_tokens = sum(steps)
    new_tokens = sum(len(r.tokens) for r in runs)
    prefill = sum(r.prefill_seconds for r in runs)
    total = sum(r.total_seconds for r in runs)
    decode = max(total - prefill, 1e-9)
    tps = decode_tokens / decode if decode_tokens else None
    tps_e2e = new_tokens / total if total > 0 else None
    t_steps = sum(s for r in target_runs for s in r.acceptance_lengths)
    t_decode = max(sum(r.total_seconds - r.prefill_seconds for r in target_runs), 1e-9)
    t_tps = t_steps / t_decode if t_steps else None
    t_tps_e2e = sum(len(r.tokens) for r in target_runs) / max(sum(r.total_seconds for r in target_runs), 1e-9)
    curve = []
    if block_size and block_size > 1 and steps:
        curve = [sum(1 for s in steps if s - 1 >= k) / len(steps) for k in range(1, block_size)]
    per_prompt = [r.tau for r in runs if r.acceptance_lengths]
    return {
        "prompts": len(runs),
        "new_tokens": new_tokens,
        "steps": len(steps),
        "tau_mean": decode_tokens / len(steps) if steps else None,
        "tau_median": float(statistics.median(steps)) if steps else None,
        "tau_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "slot_acceptance": curve,
        "prefill_seconds": prefill,
        "decode_seconds": decode,
        "total_seconds": total,
        "tokens_per_s": tps,
        "tokens_per_s_e2e": tps_e2e,
        "speedup": tps / t_tps if tps and t_tps else None,
        "speedup_e2e": tps_e2e / t_tps_e2e if tps_e2e and t_tps_e2e else None,
    }


# --------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------


def target_stop_ids(tokenizer, target) -> list[int]:
    from data.chat_masks import end_of_turn_ids

    ids: set[int] = set(end_of_turn_ids(tokenizer)) if tokenizer is not None else set()
    for value in (getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None,
                  getattr(getattr(target, "generation_config", None), "eos_token_id", None),
                  getattr(target.config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _seed(base: int, *parts: int) -> int:
    value = base
    for p in parts:
        value = (value * 1_000_003 + p) % (2**62)
    return value


def load_eval_tokenizer(target_path, settings: EvalSettings):
    from data.chat_masks import load_tokenizer

    try:
        return load_tokenizer(target_path, trust_remote_code=settings.trust_remote_code, thinking=settings.thinking), None
    except Exception as err:  # no tokenizer files, or no chat template
        return None, f"{type(err).__name__}: {err}"


def prepare(drafter_args: list[str], settings: EvalSettings, log=print):
    """Everything that can be refused, before any model weight is loaded or anything decoded:
    drafter folders, fit against the target config, traces. Returns (specs, target_path, target_config,
    tokenizer, trace_sets, notes)."""
    from drafters.target_loading import load_target_config

    from drafters.draft_config import text_config

    if settings.dtype not in EVAL_DTYPES:
        raise EvalError(f"dtype must be one of {sorted(EVAL_DTYPES)}, got {settings.dtype!r}")
    unknown = [c for c in settings.categories if c not in CATEGORIES]
    if unknown or not settings.categories:
        raise EvalError(f"trace categories must be a non-empty subset of {CATEGORIES}, got {settings.categories}")
    if settings.max_prompts < 1 or settings.max_new_tokens < 1:
        raise EvalError(f"max_prompts and max_new_tokens must be >= 1, got {settings.max_prompts}, {settings.max_new_tokens}")
    if settings.temperature < 0:
        raise EvalError(f"temperature must be >= 0, got {settings.temperature}")
    specs = [resolve_drafter(a) for a in drafter_args]
    names = [s.name for s in specs]
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & RESERVED_NAMES))
    if clash:
        raise EvalError(f"drafter names must be unique and not one of {sorted(RESERVED_NAMES)}: {clash} "
                        "(name them with name=path)")

    if settings.target is None:
        from drafters.testbed import prepare_testbed_target

        target_path = prepare_testbed_target(Path(settings.cache_dir) if settings.cache_dir else None)
    else:
        target_path = Path(settings.target)
        if not (target_path / "config.json").is_file():
            raise EvalError(f"target {target_path} is not a model folder (no config.json)")
    target_config = load_target_config(target_path, settings.trust_remote_code)
    for spec in specs:
        check_fit(spec, target_config, str(target_path))
        check_finite(spec)

    text = text_config(target_config)
    max_positions = getattr(text, "max_position_embeddings", None)
    tokenizer, tokenizer_error = load_eval_tokenizer(target_path, settings)
    notes: list[str] = []
    trace_sets: dict[str, TraceSet] = {}
    for category in settings.categories:
        if category == "agentic":
            out = Path(settings.out)
            out.mkdir(parents=True, exist_ok=True)
            trace_sets[category] = agentic_traces(
                settings.agentic_log, int(text.vocab_size), max_prompts=settings.max_prompts,
                max_new_tokens=settings.max_new_tokens, max_tokens=settings.max_tokens,
                per_session=settings.agentic_per_session, max_positions=max_positions,
                quarantine_path=out / "agentic_quarantine.jsonl")
            ingest = trace_sets[category].ingest or {}
            if ingest.get("quarantined"):
                notes.append(f"agentic log: {ingest['quarantined']} of {ingest['read']} records quarantined "
                             f"({ingest.get('by_reason')}); see {out / 'agentic_quarantine.jsonl'}")
        else:
            if tokenizer is None:
                raise TraceError(f"category {category!r} needs the target's tokenizer with a chat template; "
                                 f"loading it from {target_path} failed ({tokenizer_error})")
            trace_sets[category] = heldout_traces(
                category, tokenizer, max_prompts=settings.max_prompts, max_new_tokens=settings.max_new_tokens,
                max_tokens=settings.max_tokens, seed=settings.seed, max_chars=settings.max_chars,
                max_positions=max_positions)
    for ts in trace_sets.values():
        if ts.skipped_budget or ts.skipped_context:
            notes.append(f"{ts.category}: {ts.skipped_budget} prompt(s) left out by --max-tokens, "
                         f"{ts.skipped_context} by the context window")
    return specs, target_path, target_config, tokenizer, trace_sets, notes


def evaluate(drafter_args: list[str], settings: EvalSettings, log=print, notes: list[str] | None = None) -> dict:
    """Run the whole evaluation and write report.json, report.md and the plots under settings.out.

    Returns the report (the content of report.json). Raises EvalError / TraceError (ValueError) on input it
    refuses, before loading any weights."""
    specs, target_path, target_config, tokenizer, trace_sets, prep_notes = prepare(drafter_args, settings, log)
    notes = list(notes or []) + prep_notes
    threads_before = torch.get_num_threads()
    torch.set_num_threads(choose_threads(settings.threads))
    try:
        return _evaluate(specs, target_path, target_config, tokenizer, trace_sets, notes, settings, log)
    finally:
        torch.set_num_threads(threads_before)


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


def _evaluate(specs, target_path, target_config, tokenizer, trace_sets, notes, settings: EvalSettings, log) -> dict:
    from tqdm.auto import tqdm
    from drafters.capture import HFCapture
    from drafters.frozen_target import FrozenTargetHead
    from drafters.target_loading import load_target_model
    from eval import report as report_mod
    from eval.reference import load_reference_model, reference_generate
    from drafters.objective import acceptance_stats

    dtype = TORCH_DTYPES[settings.dtype]
    out_dir = Path(settings.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    log(f"[eval] target {target_path} ({settings.dtype}); drafters: {[s.name for s in specs] or 'none'}; "
        + ", ".join(f"{c}: {len(ts.traces)} prompts" for c, ts in trace_sets.items()))
    target = load_target_model(target_path, dtype=dtype, device_map=settings.device_map,
                               trust_remote_code=settings.trust_remote_code, offload_folder=out_dir / "offload")
    if settings.device_map is None:
        head = FrozenTargetHead.from_model(target)
    else:  # a dispatched target's embedding or head may live on another device or on disk: read them once
        device = target.get_input_embeddings().weight.device
        device = torch.device("cpu") if device.type == "meta" else device
        head = FrozenTargetHead.from_pretrained(target_path, dtype=dtype, device=device)
    drafters = {s.name: load_spec(s, dtype, target_config).to(head.embed_tokens.weight.device) for s in specs}
    references = {}
    if settings.reference_subset > 0:
        for s in specs:
            references[s.name] = load_reference_model(s.folder, dtype, fp8=s.kind == "fp8", ours=drafters[s.name])
    stop_ids = target_stop_ids(tokenizer, target)
    lookup_draft = settings.lookup_num_draft
    if lookup_draft is None:
        lookup_draft = (specs[0].block_size - 1) if specs else 15
    methods = [s.name for s in specs] + [LOOKUP, TARGET]
    block_sizes = {s.name: drafters[s.name].block_size for s in specs}
    block_sizes[LOOKUP] = lookup_draft + 1
    block_sizes[TARGET] = 1
    temperature = settings.temperature
    greedy = temperature <= 0
    union_ids = sorted({i for d in drafters.values() for i in d.target_layer_ids})
    hidden = head.hidden_size

    if settings.warmup:  # first-call allocations must not land in the first prompt's timings
        first = next(iter(trace_sets.values())).traces[0]
        ids = torch.tensor([first.input_ids[-32:]])
        target_generate(target, ids, 3, None, 0.0)
        for name, drafter in drafters.items():
            generate(drafter, target, ids, 3, None, 0.0, head=head)

    prompts: list[dict] = []
    mismatches: list[dict] = []
    runs: dict[str, dict[str, list[Decoded]]] = {c: {m: [] for m in methods} for c in trace_sets}
    sim_slots: dict[str, dict[str, list]] = {c: {s.name: [] for s in specs} for c in trace_sets}
    ref_rows: dict[str, dict[str, list]] = {c: {s.name: [] for s in specs} for c in trace_sets}
    total_prompts = sum(len(ts.traces) for ts in trace_sets.values())
    progress = tqdm(total=total_prompts, desc="eval", unit="prompt", file=sys.stderr)
    started = time.perf_counter()
    for c_index, (category, ts) in enumerate(trace_sets.items()):
        for p_index, trace in enumerate(ts.traces):
            ids = torch.tensor([trace.input_ids], dtype=torch.long)
            gen = lambda m: torch.Generator().manual_seed(_seed(settings.seed, c_index, p_index, m))  # noqa: E731
            results: dict[str, Decoded] = {}
            results[TARGET] = target_generate(target, ids, settings.max_new_tokens, stop_ids, temperature, generator=gen(0))
            results[LOOKUP] = lookup_generate(target, ids, settings.max_new_tokens, stop_ids, temperature,
                                              num_draft=lookup_draft, max_ngram=settings.lookup_max_ngram,
                                              min_ngram=settings.lookup_min_ngram, generator=gen(1))
            for m_index, spec in enumerate(specs):
                results[spec.name] = generate(drafters[spec.name], target, ids, settings.max_new_tokens, stop_ids,
                                              temperature, head=head, generator=gen(2 + m_index))
            truth = results[TARGET].tokens
            row = {"category": category, "id": trace.id, "prompt_tokens": trace.num_tokens, "meta": trace.meta,
                   "results": {}}
            for method in methods:
                r = results[method]
                runs[category][method].append(r)
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
                        mismatches.append({"method": method, "category": category, "prompt_id": trace.id,
                                           "first_diff": diff, "target_new_tokens": len(truth),
                                           "method_new_tokens": len(r.tokens),
                                           "target_tokens_at_diff": truth[diff: diff + 8],
                                           "method_tokens_at_diff": r.tokens[diff: diff + 8]})
                row["results"][method] = entry

            if settings.simulate and specs and len(truth) >= 2:
                sequence = torch.tensor([trace.input_ids + truth], dtype=torch.long)
                capture = HFCapture(target, union_ids)
                try:
                    selected = capture.capture(sequence, with_final=False).selected
                finally:
                    capture.remove()
                for spec in specs:
                    d = drafters[spec.name]
                    cols = [union_ids.index(i) for i in d.target_layer_ids]
                    feats = torch.cat([selected[..., j * hidden:(j + 1) * hidden] for j in cols], dim=-1)
                    slots = teacher_forced_slots(d, head, feats, sequence, trace.num_tokens)
                    if slots is not None:
                        sim_slots[category][spec.name].append(slots)
                        row["results"][spec.name]["sim_tau"] = acceptance_stats(*slots)["sim_tau"]

            if p_index < settings.reference_subset:
                for spec in specs:
                    theirs = reference_generate(references[spec.name], target, ids, settings.max_new_tokens, stop_ids,
                                                temperature, seed=_seed(settings.seed, c_index, p_index, 99))
                    ours = results[spec.name]
                    ref = {"tau": theirs.tau if theirs.acceptance_lengths else None,
                           "acceptance_lengths": theirs.acceptance_lengths, "new_tokens": len(theirs.tokens),
                           "prefill_seconds": theirs.prefill_seconds, "total_seconds": theirs.total_seconds,
                           "acceptance_lengths_equal": theirs.acceptance_lengths == ours.acceptance_lengths}
                    if greedy:
                        ref["identical_to_ours"] = theirs.tokens == ours.tokens
                        ref["identical_to_target"] = theirs.tokens == truth
                        diff = first_difference(theirs.tokens, truth)
                        if diff is not None:
                            mismatches.append({"method": f"reference:{spec.name}", "category": category,
                                               "prompt_id": trace.id, "first_diff": diff,
                                               "target_new_tokens": len(truth), "method_new_tokens": len(theirs.tokens),
                                               "target_tokens_at_diff": truth[diff: diff + 8],
                                               "method_tokens_at_diff": theirs.tokens[diff: diff + 8]})
                    row["results"][spec.name]["reference"] = ref
                    ref_rows[category][spec.name].append((ours, theirs, ref))
            prompts.append(row)
            progress.set_postfix_str(f"{category} " + " ".join(
                f"{m[:12]}={results[m].tau:.2f}" for m in methods if m != TARGET and results[m].acceptance_lengths))
            progress.update(1)
    progress.close()
    wall = time.perf_counter() - started

    # ---- summaries --------------------------------------------------------------------------------
    def category_summary(cat_runs, cat_sims, cat_refs):
        summary = {}
        for method in methods:
            s = summarize(cat_runs[method], cat_runs[TARGET], block_sizes[method])
            if greedy and method != TARGET:
                truth_runs = cat_runs[TARGET]
                s["identical"] = sum(r.tokens == t.tokens for r, t in zip(cat_runs[method], truth_runs))
                s["mismatched"] = s["prompts"] - s["identical"]
            summary[method] = s
        for spec in specs:
            slots = cat_sims.get(spec.name) or []
            if slots:
                stats = acceptance_stats(torch.cat([c for c, _ in slots]), torch.cat([v for _, v in slots]))
                summary[spec.name]["sim_tau"] = stats["sim_tau"]
                summary[spec.name]["sim_slot_accuracy"] = stats["slot_accuracy"]
                summary[spec.name]["sim_blocks"] = int(sum(int(v[:, 0].sum()) for _, v in slots))
            rows = cat_refs.get(spec.name) or []
            if rows:
                ours_steps = [s for o, _, _ in rows for s in o.acceptance_lengths]
                ref_steps = [s for _, t, _ in rows for s in t.acceptance_lengths]
                tau_ours = sum(ours_steps) / len(ours_steps) if ours_steps else None
                tau_ref = sum(ref_steps) / len(ref_steps) if ref_steps else None
                rel = (tau_ours - tau_ref) / tau_ref if tau_ours is not None and tau_ref else None
                ref_summary = {"prompts": len(rows), "tau_ours": tau_ours, "tau_reference": tau_ref,
                               "rel_diff": rel, "within_2pct": rel is not None and abs(rel) <= 0.02,
                               "acceptance_lengths_equal": sum(r["acceptance_lengths_equal"] for _, _, r in rows)}
                if greedy:
                    ref_summary["outputs_identical_to_ours"] = sum(r["identical_to_ours"] for _, _, r in rows)
                    ref_summary["outputs_identical_to_target"] = sum(r["identical_to_target"] for _, _, r in rows)
                ref_t = sum(t.total_seconds - t.prefill_seconds for _, t, _ in rows)
                ref_summary["reference_tokens_per_s"] = sum(ref_steps) / ref_t if ref_t > 0 and ref_steps else None
                summary[spec.name]["reference"] = ref_summary
        return summary

    categories = {}
    for category, ts in trace_sets.items():
        categories[category] = {**ts.describe(), "methods": category_summary(
            runs[category], sim_slots[category], ref_rows[category])}
    if len(trace_sets) > 1:
        merged_runs = {m: [r for c in trace_sets for r in runs[c][m]] for m in methods}
        merged_sims = {s.name: [x for c in trace_sets for x in sim_slots[c][s.name]] for s in specs}
        merged_refs = {s.name: [x for c in trace_sets for x in ref_rows[c][s.name]] for s in specs}
        categories["all"] = {"category": "all", "prompts": total_prompts,
                             "prompt_tokens": sum(ts.prompt_tokens for ts in trace_sets.values()),
                             "methods": category_summary(merged_runs, merged_sims, merged_refs)}

    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cores = os.cpu_count() or 1
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
        for spec in specs:
            ref = cat["methods"][spec.name].get("reference")
            if ref and ref["rel_diff"] is not None and abs(ref["rel_diff"]) > 0.02:
                warnings_.append(f"{category}/{spec.name}: tau ours {ref['tau_ours']:.3f} vs reference "
                                 f"{ref['tau_reference']:.3f} differs by {100 * ref['rel_diff']:+.1f}% (goal within 2%)")
    if load_start is not None and max(load_start, load_end or 0) > cores:
        warnings_.append(f"machine load average {max(load_start, load_end or 0):.1f} on {cores} cores during the run: "
                         "tokens/s and speedups are noisy (tau is not affected)")
    for w in warnings_:
        print(f"[eval] WARNING: {w}", file=sys.stderr, flush=True)

    settings_dict = asdict(settings)
    settings_dict.update({"target_path": str(target_path), "stop_ids": stop_ids, "lookup_num_draft": lookup_draft,
                          "torch_threads": torch.get_num_threads(), "cpu_count": cores,
                          "load_average": [load_start, load_end], "device": str(head.embed_tokens.weight.device),
                          "torch": torch.__version__})
    report = {
        "version": REPORT_VERSION,
        "backend": "decoder (drafters.spec_decode on the HF target, in process)",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": wall,
        "settings": settings_dict,
        "target": {"path": str(target_path), "num_hidden_layers": int(getattr(target.config, "num_hidden_layers", 0)),
                   "vocab_size": head.vocab_size, "hidden_size": hidden,
                   "testbed": settings.target is None},
        "drafters": [s.describe() for s in specs],
        "methods": methods,
        "block_sizes": block_sizes,
        "categories": categories,
        "prompts": prompts,
        "mismatches": mismatches,
        "warnings": warnings_,
        "notes": notes,
    }
    report_mod.write_report(report, out_dir)
    if settings.wandb:
        report_mod.log_wandb(report, out_dir, settings.wandb_project, settings.wandb_mode)
    log(report_mod.console_summary(report))
    log(f"[eval] report: {out_dir / 'report.md'}")
    return report


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.acceptance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", default=[], metavar="[NAME=]CKPT",
                   help="drafter folder, training checkpoint (with drafter/), output_dir or FP8 export; repeatable")
    p.add_argument("--target", default=None, help="target model folder (default: config target.path, else the testbed target)")
    p.add_argument("--traces", default=None, help="comma-separated categories: code,prose,agentic[,chat] (default: config eval.categories)")
    p.add_argument("--agentic-log", action="append", default=[], metavar="FILE_OR_DIR",
                   help="held-out agent sessions (trajectory format, token ids); repeatable")
    p.add_argument("--agentic-per-session", type=int, default=1, help="last N requests of each session (default 1)")
    p.add_argument("--max-prompts", type=int, default=None, help="per category (default: config eval.max_prompts)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: config eval.max_new_tokens")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="per category budget of prompt tokens + max_new_tokens per prompt (default: no limit)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: config eval.temperature)")
    p.add_argument("--reference-subset", type=int, default=None,
                   help="prompts per category cross-checked with z-lab's dflash_generate (default: config eval.reference_subset)")
    p.add_argument("--out", default=None, help="report folder (default: <output_dir>/eval with --config, else outputs/eval)")
    p.add_argument("--config", default=None, help="pipeline YAML (configs/*.yaml); dotted overrides may follow")
    p.add_argument("--dtype", default="float32", choices=sorted(EVAL_DTYPES),
                   help="target and drafter dtype (default float32: exact greedy comparisons; bfloat16 is faster on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-chars", type=int, default=2000, help="held-out prompt size in characters")
    p.add_argument("--lookup-max-ngram", type=int, default=3)
    p.add_argument("--lookup-num-draft", type=int, default=None, help="default: the first drafter's block size - 1")
    p.add_argument("--no-sim", action="store_true", help="skip the teacher-forced estimate")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device-map", default=None, help="shard the target in-process, e.g. auto (default: config target.device_map)")
    p.add_argument("--backend", default="decoder", choices=["decoder", "vllm"],
                   help="decoder: our decoding loop on the HF target; vllm: the serving engine (eval/engine.py)")
    p.add_argument("--engine-url", default=None, help="vllm backend: a server already serving the drafter")
    p.add_argument("--engine-baseline-url", default=None, help="vllm backend: a server serving the target alone")
    p.add_argument("--wandb", action="store_true", help="log the summary and plots to wandb (project/mode from config logging)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. eval.max_prompts=4")
    return p


def settings_from_args(args) -> EvalSettings:
    from configs.schema import load_config

    config = load_config(args.config, args.overrides)
    ev = config.eval
    categories = [c.strip() for c in args.traces.split(",") if c.strip()] if args.traces else list(ev.categories)
    notes = []
    if not args.traces and "agentic" in categories and not args.agentic_log:
        categories.remove("agentic")  # from a config, not asked for explicitly: skip without a log
        notes.append("agentic skipped: no --agentic-log given")
    out = args.out or (str(Path(config.output_dir) / "eval") if args.config else "outputs/eval")
    settings = EvalSettings(
        target=args.target or config.target.path,
        cache_dir=config.cache_dir,
        dtype=args.dtype,
        categories=categories,
        agentic_log=list(args.agentic_log),
        agentic_per_session=args.agentic_per_session,
        max_prompts=args.max_prompts if args.max_prompts is not None else ev.max_prompts,
        max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None else ev.max_new_tokens,
        max_tokens=args.max_tokens,
        temperature=args.temperature if args.temperature is not None else ev.temperature,
        reference_subset=args.reference_subset if args.reference_subset is not None else ev.reference_subset,
        seed=args.seed,
        max_chars=args.max_chars,
        lookup_max_ngram=args.lookup_max_ngram,
        lookup_num_draft=args.lookup_num_draft,
        simulate=not args.no_sim,
        warmup=not args.no_warmup,
        out=out,
        wandb=args.wandb,
        wandb_project=config.logging.wandb_project,
        wandb_mode=config.logging.wandb_mode,
        threads=args.threads,
        trust_remote_code=config.target.trust_remote_code,
        thinking=config.data.thinking,
        device_map=args.device_map if args.device_map is not None else config.target.device_map,
    )
    return settings, notes


def main(argv: list[str] | None = None) -> int:
    from configs.schema import ConfigError

    args = build_parser().parse_args(argv)
    try:
        settings, notes = settings_from_args(args)
        for note in notes:
            print(f"[eval] {note}", file=sys.stderr)
        if args.backend == "vllm":
            from eval.engine import evaluate_engine

            evaluate_engine(args.drafter, settings, args.engine_url, args.engine_baseline_url)
            return 0
        evaluate(args.drafter, settings, notes=notes)
    except (EvalError, TraceError, ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
