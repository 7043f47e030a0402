"""What an evaluation reads, and every refusal, before any weight is loaded: the drafters, the target, the traces.

A drafter is a reference-format folder (config.json + model.safetensors), a training checkpoint folder
holding ``drafter/``, a training output_dir (its newest ``checkpoints/step-*``), or an FP8 export
(config.json with "quantization_config"); ``drafters.drafter.checkpoint.find_drafter_folder`` is the one rule. It
is named by its path, or ``name=path``. Every drafter is checked against the target's config before
anything is decoded (layer ids, mask id, vocabulary, hidden size; both values named) and for finite weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen3Config

from configs.schema import PipelineConfig
from drafters.drafter.checkpoint import find_drafter_folder, load_drafter
from drafters.drafter.config import text_config, validate_target
from drafters.export.fp8 import load_fp8_drafter
from drafters.target.chat import load_tokenizer
from drafters.target.loading import load_target_config
from drafters.target.testbed import prepare_testbed_target
from eval.measures import LOOKUP, TARGET
from eval.traces import TraceError, TraceSet, agentic_traces, heldout_traces

RESERVED_NAMES = {TARGET, LOOKUP, "all"}


class EvalError(ValueError):
    """Input the evaluation refuses before decoding anything (the message names the values)."""


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
    with safe_open(str(spec.folder / "model.safetensors"), framework="pt") as f:
        bad = [name for name in f.keys() if not torch.isfinite(f.get_tensor(name).float()).all()]
    if bad:
        raise EvalError(f"drafter {spec.name!r} ({spec.folder}) has non-finite weights in {len(bad)} tensor(s) "
                        f"({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}): a diverged training run; "
                        "no tau is reported for it")


def load_spec(spec: DrafterSpec, dtype: torch.dtype, target_config):
    if spec.kind == "fp8":
        drafter = load_fp8_drafter(spec.folder, dtype=dtype)
    else:
        drafter = load_drafter(spec.folder, dtype=dtype, target_config=target_config)
    return drafter.eval().requires_grad_(False)


def report_dir(config: PipelineConfig) -> Path:
    return Path(config.eval.out) if config.eval.out else Path(config.output_dir) / "eval"


def load_eval_tokenizer(target_path, config: PipelineConfig):
    try:
        return load_tokenizer(target_path, trust_remote_code=config.target.trust_remote_code,
                              thinking=config.data.thinking), None
    except Exception as err:  # no tokenizer files, or no chat template
        return None, f"{type(err).__name__}: {err}"


def prepare(drafter_args: list[str], config: PipelineConfig, log=print):
    """Everything that can be refused, before any model weight is loaded or anything decoded:
    drafter folders, fit against the target config, traces. Returns (specs, target_path, target_config,
    tokenizer, trace_sets, notes)."""
    specs = [resolve_drafter(a) for a in drafter_args]
    names = [s.name for s in specs]
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & RESERVED_NAMES))
    if clash:
        raise EvalError(f"drafter names must be unique and not one of {sorted(RESERVED_NAMES)}: {clash} "
                        "(name them with name=path)")
    target_path = resolve_eval_target(config)
    target_config = load_target_config(target_path, config.target.trust_remote_code)
    for spec in specs:
        check_fit(spec, target_config, str(target_path))
        check_finite(spec)
    tokenizer, trace_sets, notes = load_trace_sets(config, target_path, target_config)
    return specs, target_path, target_config, tokenizer, trace_sets, notes


def resolve_eval_target(config: PipelineConfig) -> Path:
    if config.target.path is None:
        return prepare_testbed_target(Path(config.cache_dir) if config.cache_dir else None)
    target_path = Path(config.target.path)
    if not (target_path / "config.json").is_file():
        raise EvalError(f"target {target_path} is not a model folder (no config.json)")
    return target_path


def load_trace_sets(config: PipelineConfig, target_path: Path, target_config):
    """(the target's tokenizer or None, {category: TraceSet}, notes)."""
    ev = config.eval
    text = text_config(target_config)
    max_positions = getattr(text, "max_position_embeddings", None)
    tokenizer, tokenizer_error = load_eval_tokenizer(target_path, config)
    notes: list[str] = []
    trace_sets: dict[str, TraceSet] = {}
    for category in ev.categories:
        if category == "agentic":
            out = report_dir(config)
            out.mkdir(parents=True, exist_ok=True)
            trace_sets[category] = agentic_traces(
                ev.trajectories, int(text.vocab_size), max_prompts=ev.max_prompts, max_new_tokens=ev.max_new_tokens,
                max_tokens=ev.max_tokens, per_session=ev.agentic_per_session, max_positions=max_positions,
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
                category, tokenizer, max_prompts=ev.max_prompts, max_new_tokens=ev.max_new_tokens,
                max_tokens=ev.max_tokens, seed=ev.seed, max_chars=ev.max_chars, max_positions=max_positions)
    for ts in trace_sets.values():
        if ts.skipped_budget or ts.skipped_context:
            notes.append(f"{ts.category}: {ts.skipped_budget} prompt(s) left out by --max-tokens, "
                         f"{ts.skipped_context} by the context window")
    return tokenizer, trace_sets, notes
