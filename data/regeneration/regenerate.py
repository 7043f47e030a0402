"""Regenerate the responses of a set of prompts with the target model.

DFlash drafters learn the target's own distribution, so training data is the prompts with the
responses the TARGET writes. For every prompt we store the token ids the target actually saw and
produced: the prompt rendered by its chat template with ``add_generation_prompt=True``, then the
generated ids verbatim, up to and including the end-of-turn token when it was emitted (no decode /
re-encode, which is not the identity). Responses cut by ``max_new_tokens`` are kept and marked
``finished=False``. Only generated ids carry loss (``loss_mask == 1``).

Layout of ``out_dir``::

    dataset/            final `datasets` dataset (save_to_disk, Arrow); load with load_regenerated()
    work/               resumable state: config.json, shard-NNNNNN.parquet (one per finished batch;
                        shard-rRRR-NNNNNN.parquet when ranks share the work)
    features-<layers>/  with feature_layers: the target features of each batch's rows (regenerated_features.py)
    quarantine.jsonl    prompts that were not regenerated, one JSON line each with a reason
    summary.json        counts and throughput of the last call

Resuming: shards are written atomically (temp file + os.replace) after each batch; a new call with
the same settings skips prompt ids already present in shards and regenerates only the rest, so a
crash loses at most one batch. Greedy decoding is deterministic; sampling is seeded per batch from
``seed`` and the batch's prompt ids.

Batching note: the target runs in bf16 by default. In bf16, batched left-padded generation can pick
a different token than unbatched generation at near-ties (different padded shapes round differently);
both are the target's greedy output for its input shape. In fp32 (``dtype="float32"``) batched
generation equals unbatched generation token for token (tested).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from datasets import Dataset, DatasetInfo, Features, List, Value, load_from_disk
from datasets.table import InMemoryTable
from tqdm.auto import tqdm

from common import dtypes
from common.atomic_files import atomic_file, atomic_folder, write_text_atomic
from common.locks import FileLock
from configs.schema import TargetConfig
from data.feature_cache.regenerated import features_dir, write_batch_features
from drafters.target.capture import HFCapture
from drafters.target.chat import (
    PromptLike,
    build_from_generation,
    load_tokenizer,
    prompt_field,
    prompt_ids,
)
from drafters.target.fingerprint import target_fingerprint
from drafters.target.loading import load_target_config, load_target_model
from engines.hf.generation import BatchGenerator, stop_token_ids
from engines.settings import context_length
from engines.sglang.generation import SGLangGenerator
from engines.vllm.generation import VLLMGenerator

DATASET_DIR = "dataset"
WORK_DIR = "work"
QUARANTINE_FILE = "quarantine.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.json"
LOCK_FILE = ".lock"
SHARD_GLOB = "shard-*.parquet"

COLUMNS = ("prompt_id", "category", "source", "input_ids", "loss_mask", "finished", "num_generated",
           "num_prompt_tokens")

__all__ = [
    "COLUMNS", "RegenerationInterrupted", "dataset_schema", "load_regenerated", "read_quarantine", "regenerate",
]


def dataset_schema():
    """The dataset schema (``datasets.Features``)."""
    return Features({
        "prompt_id": Value("string"),
        "category": Value("string"),
        "source": Value("string"),
        "input_ids": List(Value("int32")),
        "loss_mask": List(Value("int8")),
        "finished": Value("bool"),
        "num_generated": Value("int32"),
        "num_prompt_tokens": Value("int32"),
    })


def _arrow_schema():
    return pa.schema([
        ("prompt_id", pa.string()), ("category", pa.string()), ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
        ("finished", pa.bool_()), ("num_generated", pa.int32()), ("num_prompt_tokens", pa.int32()),
    ])


class RegenerationInterrupted(RuntimeError):
    """Raised when ``max_batches`` stops a run before every prompt is done (the shards stay; call again)."""

    def __init__(self, done: int, remaining: int):
        super().__init__(f"stopped after the batch limit: {done} prompts done, {remaining} remaining; "
                         "call regenerate() again with the same out_dir to resume")
        self.done, self.remaining = done, remaining


@dataclass
class _Prompt:
    index: int
    id: str
    category: str
    source: str
    messages: list[dict]
    ids: list[int] | None = None


# --------------------------------------------------------------------------------------------------
# Small file helpers
# --------------------------------------------------------------------------------------------------


def _write_shard(path: Path, rows: list[dict]) -> None:
    table = pa.Table.from_pylist(rows, schema=_arrow_schema())
    with atomic_file(path) as f:
        pq.write_table(table, f)


def _read_shards(work: Path, columns: list[str] | None = None):
    """All shard rows as one Arrow table (later shards win for a repeated prompt id)."""
    schema = _arrow_schema()
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    tables = [pq.read_table(shard, columns=columns, schema=schema) for shard in sorted(work.glob(SHARD_GLOB))]
    return pa.concat_tables(tables) if tables else schema.empty_table()


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------


def _normalise(prompts: Iterable[PromptLike | dict]) -> list[_Prompt]:
    out, seen = [], set()
    for i, p in enumerate(prompts):
        pid = prompt_field(p, "id")
        if pid is None or str(pid) == "":
            raise ValueError(f"prompt #{i} has no id")
        pid = str(pid)
        if pid in seen:
            raise ValueError(f"duplicate prompt id {pid!r}: ids key resumption and must be unique")
        seen.add(pid)
        messages = [dict(m) for m in (prompt_field(p, "messages") or [])]
        out.append(_Prompt(index=i, id=pid, category=str(prompt_field(p, "category", "") or ""),
                           source=str(prompt_field(p, "source", "") or ""), messages=messages))
    return out


def _prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation up to the response to regenerate: trailing assistant turns are that response."""
    messages = list(messages)
    while messages and messages[-1].get("role") == "assistant":
        messages.pop()
    return messages


def read_quarantine(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / QUARANTINE_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_regenerated(out_dir: str | Path):
    """The final dataset written by :func:`regenerate`."""
    return load_from_disk(str(Path(out_dir) / DATASET_DIR))


# --------------------------------------------------------------------------------------------------
# Main entry point
# --------------------------------------------------------------------------------------------------


VLLM_PROMPTS_PER_CALL = 256


def _generator(backend: str, target_path: Path, tokenizer, engine: TargetConfig, max_new_tokens: int,
               max_model_len: int, temperature: float, top_p: float, top_k: int, seed: int,
               feature_layers: list[int] | None):
    """(generate(batch) -> (response ids per prompt, GeneratedFeatures or None), eos ids) for the backend,
    started from the config's engine settings (engines/settings.py)."""
    if backend in ("vllm", "sglang"):
        eos_ids = stop_token_ids(target_path, tokenizer)
        adapter = VLLMGenerator if backend == "vllm" else SGLangGenerator
        engine_generate = adapter(engine, target_path, max_model_len=max_model_len, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=eos_ids)
        return (lambda batch: (engine_generate([p.ids for p in batch]), None)), eos_ids

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_target_model(target_path, dtype=dtypes.torch_dtype(engine.dtype, device),
                              device_map=engine.device_map if device != "cpu" else None,
                              trust_remote_code=engine.trust_remote_code)
    if engine.device_map is None or device == "cpu":
        model = model.to(device)
    generator = BatchGenerator(model, tokenizer, temperature, seed, top_p=top_p, top_k=top_k)
    tap = HFCapture(model, feature_layers) if feature_layers else None

    def generate(batch: list[_Prompt]):
        return generator.generate_with_features([p.ids for p in batch], max_new_tokens, [p.id for p in batch], tap)

    return generate, generator.eos_ids


def regenerate(
    prompts: Iterable[PromptLike | dict],
    target_path: str | Path,
    out_dir: str | Path,
    *,
    batch_size: int = 16,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    max_prompt_tokens: int | None = 2048,
    dtype: str = "auto",
    chat_template: str | None = None,
    sort_by_length: bool = True,
    max_batches: int | None = None,
    num_threads: int | None = None,
    progress: bool = True,
    backend: str = "hf",
    feature_layers: list[int] | None = None,
    trust_remote_code: bool = False,
    thinking: bool | None = None,
    fingerprint: str = "content",
    engine: TargetConfig | None = None,
    share: tuple[int, int] | None = None,
):
    """Regenerate every prompt's response with the target at ``target_path``; return the final dataset.

    prompts: objects or dicts with ``id`` (unique), ``category``, ``messages``, ``source``. A trailing
        assistant message is treated as the response to replace and dropped from the prompt.
    temperature: 0 -> greedy; > 0 -> sampling at that temperature (``top_p``/``top_k`` optional, off by
        default: pure temperature sampling).
    max_prompt_tokens: prompts whose template rendering is longer are quarantined (recorded in
        ``quarantine.jsonl`` with the reason, counted in ``summary.json``), never dropped silently. So are
        prompts that render to nothing / fail to render / have no user turn, and prompts whose length
        plus ``max_new_tokens`` exceeds the target's context.
    sort_by_length: batch prompts of similar length together (less padding).
    backend: "hf" (transformers generate, batched and left padded) or "vllm" (the serving engine:
        continuous batching; on the 2-core testbed it was not faster, BENCHMARKS.md).
    max_batches: stop after this many new batches, raising :class:`RegenerationInterrupted` if prompts
        remain (the finished shards stay; calling again resumes).
    feature_layers: also keep these target layers' features (and the final hidden state) of every row,
        from the forwards generation runs anyway (hf backend), for the feature cache to reuse
        (data/feature_cache/regenerated.py).
    engine: the config's engine settings (`target:`): device_map for hf; parallelism, context length, memory
        share and quantization for vLLM and SGLang. None: dtype and trust_remote_code, defaults otherwise.
    share: (rank, world_size): regenerate only this rank's prompts (by a hash of each id, so a restarted rank
        takes the same ones), into shard files of its own under its own lock, and return None. Every rank
        resumes on its own; a call without `share` once all are done writes the final dataset.
    """
    _check_arguments(backend, batch_size, max_new_tokens, temperature)
    engine = engine or TargetConfig(dtype=dtype, trust_remote_code=trust_remote_code)
    torch_dtype = dtypes.torch_dtype(engine.dtype)
    if num_threads:
        torch.set_num_threads(num_threads)

    target_path, out_dir = Path(target_path), Path(out_dir)
    work = out_dir / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    items = _normalise(prompts)
    tokenizer = load_tokenizer(target_path, chat_template, trust_remote_code=trust_remote_code, thinking=thinking)
    context = getattr(load_target_config(target_path, trust_remote_code), "max_position_embeddings", None)
    valid, quarantined = _screen_prompts(items, tokenizer, max_prompt_tokens, max_new_tokens, context)
    settings = {
        "target": target_fingerprint(target_path, fingerprint),  # content: a target changed in place is not resumed
        "max_new_tokens": max_new_tokens, "temperature": float(temperature),
        "top_p": float(top_p) if temperature > 0 else None, "top_k": int(top_k) if temperature > 0 else None,
        "seed": int(seed) if temperature > 0 else None, "dtype": str(torch_dtype),
        "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
    }
    if backend != "hf":  # engines round differently; HF shards keep their original settings key
        settings["backend"] = backend

    started = time.time()
    stats = {"new_batches": 0, "generated_tokens": 0, "generation_seconds": 0.0}
    rank, world = share or (0, 1)
    lock = work / (LOCK_FILE if share is None else f"{LOCK_FILE}-rank{rank:03d}")
    with FileLock(lock, f"{work.parent} is being regenerated by another process" + (f" as rank {rank}" if share else "")):
        prefix = "shard-" if share is None else f"shard-r{rank:03d}-"
        _open_work(work, settings, out_dir, quarantined, prefix)
        done_ids = set(_read_shards(work, ["prompt_id"]).column("prompt_id").to_pylist())
        pending = [p for p in valid if p.id not in done_ids and (share is None or owner(p.id, world) == rank)]
        if sort_by_length:
            pending.sort(key=_generation_order)
        if pending:
            longest = max(len(p.ids) for p in pending) + max_new_tokens
            max_model_len = context_length(engine, min(longest, context or longest), "regeneration")
            generate, eos_ids = _generator(backend, target_path, tokenizer, engine, max_new_tokens, max_model_len,
                                           temperature, top_p, top_k, seed, feature_layers)
            if backend == "vllm":
                # The engine batches continuously: hand it many prompts per call, one shard per call.
                batch_size = max(batch_size, VLLM_PROMPTS_PER_CALL)
            _generate_pending(pending, len(done_ids), generate, set(eos_ids), batch_size, max_batches, out_dir,
                              feature_layers, stats, progress, prefix)
        if share is not None:
            return None
        table = _write_final_dataset(work, valid, out_dir / DATASET_DIR)

    summary = _summary(table, len(items), quarantined, stats, time.time() - started, settings)
    write_text_atomic(out_dir / SUMMARY_FILE, json.dumps(summary, indent=2))
    return load_from_disk(str(out_dir / DATASET_DIR))


def regeneration_order(prompts: Iterable[PromptLike | dict], tokenizer, max_prompt_tokens: int | None,
                       max_new_tokens: int, context: int | None) -> list[list[int]]:
    """The template ids of the prompts `regenerate` would generate, in the order it generates them (by length)."""
    valid, _ = _screen_prompts(_normalise(prompts), tokenizer, max_prompt_tokens, max_new_tokens, context)
    return [p.ids for p in sorted(valid, key=_generation_order)]


def _generation_order(p: _Prompt) -> tuple[int, int]:
    """Shortest prompts first (batches pad less), ties in the mixture's order."""
    return len(p.ids), p.index


def _check_arguments(backend: str, batch_size: int, max_new_tokens: int, temperature: float) -> None:
    if backend not in ("hf", "vllm", "sglang"):
        raise ValueError(f"backend must be 'hf', 'vllm' or 'sglang', got {backend!r}")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be >= 1")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")


def _screen_prompts(items: list[_Prompt], tokenizer, max_prompt_tokens: int | None, max_new_tokens: int,
                    context: int | None) -> tuple[list[_Prompt], list[dict]]:
    """The prompts to regenerate (their template ids set), and a quarantine record for each of the others."""
    valid: list[_Prompt] = []
    quarantined: list[dict] = []

    def quarantine(p: _Prompt, reason: str, detail: str = "", **extra) -> None:
        quarantined.append({"prompt_id": p.id, "category": p.category, "source": p.source,
                            "reason": reason, "detail": detail, **extra})

    for p in items:
        messages = _prompt_messages(p.messages)
        if not any(m.get("role") == "user" for m in messages):
            quarantine(p, "no_user_turn", "the prompt has no user message to answer")
            continue
        try:
            p.ids = prompt_ids(tokenizer, messages)
        except Exception as exc:  # a template error for this prompt only
            quarantine(p, "template_error", f"{type(exc).__name__}: {exc}")
            continue
        if not p.ids:
            quarantine(p, "empty_prompt", "the template rendered no tokens")
        elif max_prompt_tokens is not None and len(p.ids) > max_prompt_tokens:
            quarantine(p, "prompt_too_long", f"{len(p.ids)} prompt tokens > max_prompt_tokens={max_prompt_tokens}",
                       num_prompt_tokens=len(p.ids), limit=max_prompt_tokens)
        elif context is not None and len(p.ids) + max_new_tokens > context:
            quarantine(p, "exceeds_context", f"{len(p.ids)} prompt + {max_new_tokens} new tokens > context {context}",
                       num_prompt_tokens=len(p.ids), limit=context)
        else:
            valid.append(p)
    return valid, quarantined


def _open_work(work: Path, settings: dict, out_dir: Path, quarantined: list[dict], shard_prefix: str = "shard-") -> None:
    """Refuses shards made with other settings, records this call's quarantine, clears dead temp files."""
    config_path = work / CONFIG_FILE
    if config_path.exists():
        previous = json.loads(config_path.read_text())
        if previous != settings:
            diff = {k: (previous.get(k), v) for k, v in settings.items() if previous.get(k) != v}
            raise ValueError(f"{work} holds shards made with other settings {diff}; use a new out_dir "
                             "or delete the work folder")
    else:
        write_text_atomic(config_path, json.dumps(settings, indent=2))
    # Rewritten (not appended to) on every call: it lists this call's quarantined prompts.
    write_text_atomic(out_dir / QUARANTINE_FILE, "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in quarantined))
    for stale in work.glob(f".{shard_prefix}*.tmp*"):  # this caller's own: other ranks may be writing theirs
        stale.unlink(missing_ok=True)


def owner(prompt_id: str, world_size: int) -> int:
    """The rank that regenerates a prompt: the same on every restart, whatever the order of the prompts."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode("utf-8")).digest()[:8], "big") % world_size


def _generate_pending(pending: list[_Prompt], num_done: int, generate, eos_set: set[int], batch_size: int,
                      max_batches: int | None, out_dir: Path, feature_layers, stats: dict, progress: bool,
                      shard_prefix: str = "shard-") -> None:
    """One shard (and its features) per batch, each written atomically, so a killed call loses one batch.
    shard_prefix: "shard-" alone, "shard-rNNN-" for one rank of several (each numbers its own shards)."""
    work = out_dir / WORK_DIR
    mine = [s for s in work.glob(f"{shard_prefix}*.parquet") if s.stem[len(shard_prefix):].isdigit()]
    next_shard = 1 + max((int(s.stem[len(shard_prefix):]) for s in mine), default=-1)
    bar = tqdm(total=len(pending), unit="prompt", desc="regenerate", disable=not progress, dynamic_ncols=True)
    try:
        for start in range(0, len(pending), batch_size):
            if max_batches is not None and stats["new_batches"] >= max_batches:
                raise RegenerationInterrupted(num_done, len(pending) - start)
            batch = pending[start:start + batch_size]
            t0 = time.perf_counter()
            responses, batch_features = generate(batch)
            stats["generation_seconds"] += time.perf_counter() - t0
            rows, row_features = _shard_rows(batch, responses, batch_features, eos_set)
            if row_features:  # before the token shard: a shard on disk always has its features
                write_batch_features(features_dir(out_dir, feature_layers) / f"{shard_prefix}{next_shard:06d}.safetensors",
                                     row_features)
            _write_shard(work / f"{shard_prefix}{next_shard:06d}.parquet", rows)
            next_shard += 1
            num_done += len(batch)
            stats["new_batches"] += 1
            stats["generated_tokens"] += sum(row["num_generated"] for row in rows)
            bar.update(len(batch))
            bar.set_postfix({"tok/s": f"{stats['generated_tokens'] / max(stats['generation_seconds'], 1e-9):.1f}"})
    finally:
        bar.close()


def _shard_rows(batch: list[_Prompt], responses: list[list[int]], batch_features, eos_set: set[int]):
    """Each prompt's row (ids cut after the first end-of-turn token), and its kept features when there are any."""
    rows, row_features = [], []
    for b, (p, row) in enumerate(zip(batch, responses)):
        cut = next((k for k, t in enumerate(row) if t in eos_set), None)
        generated = row if cut is None else row[:cut + 1]
        seq = build_from_generation(p.ids, generated)
        rows.append({"prompt_id": p.id, "category": p.category, "source": p.source,
                     "input_ids": seq.input_ids, "loss_mask": seq.loss_mask,
                     "finished": cut is not None, "num_generated": len(generated),
                     "num_prompt_tokens": len(p.ids)})
        if batch_features is not None:
            row_features.append((seq.input_ids, *batch_features.row(b, len(p.ids), len(generated))))
    return rows, row_features


def _write_final_dataset(work: Path, valid: list[_Prompt], final: Path):
    """Every valid prompt's row in input order, saved atomically as a `datasets` dataset; returns its table."""
    table = _read_shards(work)
    position = {pid: k for k, pid in enumerate(table.column("prompt_id").to_pylist())}
    missing = [p.id for p in valid if p.id not in position]
    if missing:
        raise RuntimeError(f"internal error: {len(missing)} prompts have no shard row, e.g. {missing[:3]}")
    table = table.take(pa.array([position[p.id] for p in sorted(valid, key=lambda p: p.index)], pa.int64()))
    dataset = Dataset(InMemoryTable(table.select(list(COLUMNS))), info=DatasetInfo(features=dataset_schema()))
    with atomic_folder(final) as tmp:
        dataset.save_to_disk(str(tmp))
    return table


def _summary(table, num_prompts: int, quarantined: list[dict], stats: dict, seconds: float, settings: dict) -> dict:
    finished = int(pc.sum(table.column("finished").cast(pa.int64())).as_py() or 0)
    gen_time = stats["generation_seconds"]
    return {
        "prompts": num_prompts, "regenerated": table.num_rows, "quarantined": len(quarantined),
        "quarantine_reasons": {r: sum(q["reason"] == r for q in quarantined) for r in sorted({q["reason"] for q in quarantined})},
        "finished": finished, "truncated": table.num_rows - finished,
        "response_tokens": int(pc.sum(table.column("num_generated")).as_py() or 0),
        "total_tokens": int(pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0),
        "this_call": {"new_batches": stats["new_batches"], "generated_tokens": stats["generated_tokens"],
                      "generation_seconds": round(gen_time, 3),
                      "tokens_per_second": round(stats["generated_tokens"] / gen_time, 2) if gen_time else None,
                      "seconds": round(seconds, 2)},
        "settings": settings,
    }
