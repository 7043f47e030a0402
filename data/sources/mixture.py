"""The general mixture: code, prose and chat prompts in configured proportions, responses regenerated.

The regenerated dataset is cached under <cache>/datasets/mixture-<key>, where the key covers the
mixture settings, the seed and the target's identity; an interrupted build resumes where it stopped.

Prefilled samples (data.mixture.prefilled_samples) cost no decoding: a code or prose prompt whose
assistant turn restates the prompt's code or excerpt (data.mixture.prefilled_weights). The target did
not write that text, so it trains only along the target's greedy path (train.anchor_scope: sequence),
which on restated text is most of it: the drafter learns to copy from the context, what coding agents do
all day. A prefilled token costs one target forward; a regenerated one costs a decode step as well.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from datasets import Dataset, concatenate_datasets

from common.atomic_files import write_text_atomic
from common.dtypes import dtype_name, torch_dtype
from configs.schema import DataConfig, MixtureConfig, TargetConfig
from data.feature_cache.regenerated import RegeneratedFeatures, features_dir
from data.regeneration.regenerate import load_regenerated, read_quarantine, regenerate
from data.sources.builtin import iter_prompts
from data.sources.user_files import read_source, sample, source_content_hash
from drafters.target.chat import (
    build_from_generation,
    encode,
    load_tokenizer,
    prompt_ids,
)
from drafters.target.fingerprint import target_fingerprint

# Characters per prompt token for the prompt builders' budget; longer prompts are quarantined by
# the regeneration step (counted and recorded), not cut.
CHARS_PER_TOKEN = 3
MANIFEST = "manifest.json"
SOURCES_QUARANTINE = "sources_quarantine.jsonl"


def category_counts(weights: dict[str, float], total: int) -> dict[str, int]:
    """Split total over the categories by weight (largest remainder, deterministic)."""
    norm = sum(weights.values())
    exact = {c: total * w / norm for c, w in weights.items()}
    counts = {c: int(v) for c, v in exact.items()}
    for c in sorted(exact, key=lambda c: (counts[c] - exact[c], c))[: total - sum(counts.values())]:
        counts[c] += 1
    return counts


class MixtureError(ValueError):
    """A mixture that its sources cannot fill; the message names the source and the settings."""


@dataclass
class DrawnPrompts:
    """The mixture's prompts, what each source gave (for the manifest) and what it quarantined."""

    prompts: list = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)
    quarantined: list = field(default_factory=list)  # data.trajectory.quarantine.QuarantineItem
    every_turn: set[str] = field(default_factory=set)  # sources whose later user turns are answered in rounds


def draw_prompts(data: DataConfig, split: str = "train") -> DrawnPrompts:
    """num_samples prompts over data.mixture's sources by weight (largest remainder), each source's share
    capped by its limit. A source that gives fewer than its share is refused, before any regeneration,
    unless data.mixture.accept_fewer."""
    mixture = data.mixture
    max_chars = mixture.max_prompt_tokens * CHARS_PER_TOKEN
    sources = mixture.source_list
    shares = category_counts({s.source_name: s.weight for s in sources}, mixture.num_samples)
    drawn, seen, short = DrawnPrompts(), set(), []
    for source in sources:
        name, share = source.source_name, shares[source.source_name]
        want = min(share, source.limit) if source.limit else share
        entry = {"name": name, "category": source.source_category, "weight": source.weight, "share": share}
        if source.builtin:
            stream = iter_prompts(source.builtin, split, seed=data.seed, max_chars=max_chars,
                                  heldout_fraction=mixture.heldout_fraction, passes=None)
            prompts = list(islice(stream, want))
            entry.update(builtin=source.builtin, drawn=len(prompts))
        else:
            read = read_source(name, source.path, source.format, source.source_category, split=split,
                               heldout_fraction=mixture.heldout_fraction, max_chars=max_chars, turns=source.turns,
                               seen=seen)
            prompts = sample(read.prompts, want, data.seed)
            entry.update(path=str(source.path), format=source.format, turns=source.turns, drawn=len(prompts),
                         content_sha256=source_content_hash(source.path), read=read.read,
                         accepted=len(read.prompts) + read.heldout, in_split=len(read.prompts), other_split=read.heldout,
                         quarantined=len(read.quarantined), quarantined_by_reason=read.by_reason)
            drawn.quarantined += read.quarantined
            if source.turns == "every":
                drawn.every_turn.add(name)
        if len(prompts) < share:
            short.append(f"{name}: {len(prompts)} of its share of {share}"
                         + (f" (limit {source.limit})" if source.limit and source.limit < share else ""))
        drawn.sources.append(entry)
        drawn.prompts.extend(prompts)
    if short:
        message = (f"data.mixture.num_samples={mixture.num_samples} asks for more prompts than the sources hold: "
                   + "; ".join(short))
        if not mixture.accept_fewer:
            raise MixtureError(f"{message}. Lower data.mixture.num_samples, add sources, or set "
                               "data.mixture.accept_fewer: true to train on fewer")
        print(f"[data] {message}; data.mixture.accept_fewer: the mixture has {len(drawn.prompts)} prompts", flush=True)
    return drawn


def mixture_prompts(data: DataConfig, split: str = "train") -> list:
    return draw_prompts(data, split).prompts


def _restated(prompt) -> str:
    """What a prefilled assistant turn says: the prompt's fenced code, or its prose excerpt (every prose
    task template puts the excerpt after the instruction's only blank line)."""
    content = prompt.messages[-1]["content"]
    if prompt.category == "code":
        return content[content.index("```python\n"):content.rindex("```") + 3]
    return content.partition("\n\n")[2]


def prefilled_rows(data: DataConfig, tokenizer) -> list[dict]:
    """Code and prose prompts (train split, drawn with their own seed, apart from the regenerated ones)
    answered by restating their code or excerpt; rows shaped like the regenerated dataset's, with
    num_generated 0 (the target wrote none)."""
    mixture = data.mixture
    rows = []
    for category, count in category_counts(mixture.prefilled_weights, mixture.prefilled_samples).items():
        stream = iter_prompts(category, "train", seed=data.seed + 1, max_chars=mixture.max_prompt_tokens * CHARS_PER_TOKEN,
                              heldout_fraction=mixture.heldout_fraction, passes=None)
        for prompt in islice(stream, count):
            ids = prompt_ids(tokenizer, prompt.messages)
            seq = build_from_generation(ids, encode(tokenizer, _restated(prompt)) + [tokenizer.eos_token_id])
            rows.append({"prompt_id": f"prefilled:{prompt.id}", "category": prompt.category, "source": prompt.source,
                         "input_ids": seq.input_ids, "loss_mask": seq.loss_mask, "finished": True,
                         "num_generated": 0, "num_prompt_tokens": len(ids)})
    return rows


def mixture_key(data: DataConfig, target: TargetConfig, target_path: Path) -> str:
    # Settings that do not change the regenerated text stay out of the key (hf: caches made before the
    # backend setting existed keep their key).

    mixture = data.mixture
    ignored = {"prefilled_samples", "prefilled_weights", "accept_fewer", "generation_backend"}
    settings = {"mixture": mixture.model_dump(mode="json", exclude=ignored), "seed": data.seed,
                "target": target_fingerprint(target_path, target.fingerprint)}  # its content, not its path
    if data.mixture.backend(target) != "hf":  # engines round differently from transformers
        settings["backend"] = data.mixture.backend(target)
    files = {s.source_name: source_content_hash(s.path) for s in mixture.sources if s.path}
    if files:  # the user's prompt files by content: an edited file is a new mixture
        settings["source_content"] = files
    compute_dtype = dtype_name(torch_dtype(target.dtype))
    if compute_dtype != "bfloat16":  # greedy text differs between dtypes at near-ties; bf16 caches keep their key
        settings["target_dtype"] = compute_dtype
    if data.thinking is not None:  # unset: caches made before the setting existed keep their key
        settings["thinking"] = data.thinking
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def mixture_dir(data: DataConfig, target: TargetConfig, target_path: Path, cache_root: Path) -> Path:
    return Path(cache_root) / "datasets" / f"mixture-{mixture_key(data, target, target_path)}"


def regenerated_features(data: DataConfig, target: TargetConfig, target_path: Path, cache_root: Path,
                         layer_ids: list[int]):
    """The target features regeneration kept for these layers (data/feature_cache/regenerated.py), or None."""
    folder = features_dir(mixture_dir(data, target, target_path, cache_root), layer_ids)
    return RegeneratedFeatures(folder) if folder.is_dir() else None


def greedy_response_spans(mixture: MixtureConfig, dataset) -> list[tuple[int, int]] | None:
    """Per row of the stage-1 mixture, the positions [lo, hi) whose target greedy choice is the next token:
    a greedily regenerated response is the target's argmax at every step, so training reads those choices
    from the row instead of projecting its final hidden states onto the vocabulary again. Prefilled rows
    (num_generated 0) get an empty span. None: sampled, not greedy. Only for rows from the mixture
    (`rows_from`)."""
    if mixture.temperature > 0:
        return None
    return [(p - 1, p + g - 1) if g else (0, 0)
            for p, g in zip(dataset["num_prompt_tokens"], dataset["num_generated"])]


def build_mixture(data: DataConfig, target: TargetConfig, target_path: Path, cache_root: Path,
                  feature_layers: list[int] | None = None, ranks=None) -> Dataset:
    """feature_layers: keep those target layers' features while regenerating, for the feature cache.
    ranks: the process group (accelerate's state) when several processes share the regeneration: each
    regenerates its share of the prompts (data/regeneration/regenerate.py `share`) and resumes it on its own; then the
    main process writes the dataset. Called by every process of the group.
    Writes manifest.json (sources and their counts, the target's fingerprint, template, thinking setting,
    generation settings, quarantine counts) and sources_quarantine.jsonl beside the dataset."""
    mixture = data.mixture
    out_dir = mixture_dir(data, target, target_path, cache_root)
    drawn = draw_prompts(data)
    print(f"[data] general mixture: {len(drawn.prompts)} prompts from {len(drawn.sources)} source(s) -> {out_dir}", flush=True)
    if drawn.quarantined:
        print(f"[data] sources: {len(drawn.quarantined)} record(s) quarantined -> {out_dir / SOURCES_QUARANTINE}", flush=True)
    shared = ranks is not None and ranks.num_processes > 1
    main = not shared or ranks.is_main_process
    out_dir.mkdir(parents=True, exist_ok=True)
    if main:
        write_text_atomic(out_dir / SOURCES_QUARANTINE, "".join(json.dumps(q.to_dict(), ensure_ascii=False) + "\n"
                                                               for q in drawn.quarantined))
    tokenizer = load_tokenizer(target_path, trust_remote_code=target.trust_remote_code, thinking=data.thinking)

    def regenerate_all(prompts: list) -> Dataset:
        def run(share=None):
            return regenerate(
                prompts, target_path, out_dir, batch_size=mixture.generation_batch_size,
                max_new_tokens=mixture.max_new_tokens, temperature=mixture.temperature, seed=data.seed,
                max_prompt_tokens=mixture.max_prompt_tokens, dtype=target.dtype,
                backend=data.mixture.backend(target), feature_layers=feature_layers,
                trust_remote_code=target.trust_remote_code, thinking=data.thinking,
                fingerprint=target.fingerprint, engine=target, share=share)

        if not shared:
            return run()
        run((ranks.process_index, ranks.num_processes))
        ranks.wait_for_everyone()
        if main:
            run()  # every share is done: this writes the dataset
        ranks.wait_for_everyone()
        return load_regenerated(out_dir)

    regenerated, rounds = answer_every_turn(drawn, regenerate_all, tokenizer)
    if main:
        write_manifest(out_dir, data, target, target_path, tokenizer, drawn, regenerated, rounds, read_quarantine(out_dir))
    if shared:  # no process reads the manifest (prepare prints it) before the main process has written it
        ranks.wait_for_everyone()
    if not mixture.prefilled_samples:
        return regenerated
    rows = prefilled_rows(data, tokenizer)
    print(f"[data] prefilled samples: {len(rows)} ({sum(len(r['input_ids']) for r in rows)} tokens, no decoding)", flush=True)
    return concatenate_datasets([regenerated, Dataset.from_list(rows, features=regenerated.features)])


def answer_every_turn(drawn: DrawnPrompts, regenerate_all, tokenizer) -> tuple[Dataset, int]:
    """Regenerate the prompts; then, in rounds, the next user turn of every conversation from a
    `turns: every` source, after the target's own answer to the turn before (a new row each, id
    `<id>@turn<k>`). An answer cut at max_new_tokens is kept as the target wrote it; a conversation stops
    where regeneration quarantined a turn (over max_prompt_tokens, say). Every round's call
    resumes the earlier rounds' shards, so a killed build loses at most one batch. Returns the dataset and
    the number of rounds."""
    prompts = list(drawn.prompts)
    dataset = regenerate_all(prompts)
    pending = [p for p in prompts if p.source in drawn.every_turn and p.followups]
    rounds = 1
    while pending:
        rows = {r["prompt_id"]: r for r in dataset.select_columns(
            ["prompt_id", "input_ids", "finished", "num_generated", "num_prompt_tokens"])}
        following = []
        for prompt in pending:
            row = rows.get(prompt.id)
            if row is None:
                continue
            start = row["num_prompt_tokens"]
            answer = tokenizer.decode(row["input_ids"][start:start + row["num_generated"]], skip_special_tokens=True)
            base_id = prompt.id.split("@turn")[0]
            following.append(dataclasses.replace(
                prompt, id=f"{base_id}@turn{rounds + 1}", followups=prompt.followups[1:],
                messages=[*prompt.messages, {"role": "assistant", "content": answer.strip()},
                          {"role": "user", "content": prompt.followups[0]}]))
        if not following:
            break
        rounds += 1
        print(f"[data] turn {rounds}: {len(following)} conversation(s) continue after the target's own answers", flush=True)
        prompts += following
        dataset = regenerate_all(prompts)
        pending = [p for p in following if p.followups]
    return dataset, rounds


def write_manifest(out_dir: Path, data: DataConfig, target: TargetConfig, target_path: Path, tokenizer, drawn: DrawnPrompts,
                   dataset: Dataset, rounds: int, regeneration_quarantine: list[dict]) -> dict:
    """What the prepared mixture is: enough to tell two of them apart, or to rebuild one."""
    mixture = data.mixture
    rows = Counter(pid.split(":", 1)[0] for pid in dataset["prompt_id"]) if len(dataset) else Counter()
    for entry in drawn.sources:  # every prompt id starts with its source's name (a built-in corpus's is its name)
        entry["rows"] = rows.get(entry["name"], 0)
    manifest = {
        "kind": "dflash-prepared-mixture",
        "target": {"path": str(Path(target_path).resolve()), "fingerprint": target_fingerprint(target_path, target.fingerprint),
                   "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
                   "thinking": data.thinking, "dtype": target.dtype},
        "generation": {"backend": data.mixture.backend(target),
                       "engine": target.model_dump(mode="json", exclude={"path", "fingerprint"}), "max_new_tokens": mixture.max_new_tokens,
                       "max_prompt_tokens": mixture.max_prompt_tokens, "temperature": mixture.temperature,
                       "seed": data.seed, "rounds": rounds},
        "sources": drawn.sources,
        "prompts": len(drawn.prompts),
        "rows": len(dataset),
        "quarantine": {"sources": len(drawn.quarantined),
                       "sources_by_reason": dict(Counter(q.reason for q in drawn.quarantined)),
                       "regeneration": len(regeneration_quarantine),
                       "regeneration_by_reason": dict(Counter(q.get("reason", "?") for q in regeneration_quarantine))},
    }
    write_text_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=2, default=str))
    return manifest
