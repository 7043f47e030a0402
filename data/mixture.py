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

import hashlib
import json
from itertools import islice
from pathlib import Path

from datasets import Dataset, concatenate_datasets

from common.dtypes import dtype_name, torch_dtype
from configs.schema import PipelineConfig

# Characters per prompt token for the prompt builders' budget; longer prompts are quarantined by
# the regeneration step (counted and recorded), not cut.
CHARS_PER_TOKEN = 3


def category_counts(weights: dict[str, float], total: int) -> dict[str, int]:
    """Split total over the categories by weight (largest remainder, deterministic)."""
    norm = sum(weights.values())
    exact = {c: total * w / norm for c, w in weights.items()}
    counts = {c: int(v) for c, v in exact.items()}
    for c in sorted(exact, key=lambda c: (counts[c] - exact[c], c))[: total - sum(counts.values())]:
        counts[c] += 1
    return counts


def mixture_prompts(config: PipelineConfig, split: str = "train") -> list:
    from data.sources import iter_prompts

    mixture = config.data.mixture
    prompts = []
    for category, count in category_counts(mixture.weights, mixture.num_samples).items():
        if count == 0:
            continue
        stream = iter_prompts(category, split, seed=config.data.seed, max_chars=mixture.max_prompt_tokens * CHARS_PER_TOKEN,
                              heldout_fraction=mixture.heldout_fraction, passes=None)
        drawn = list(islice(stream, count))
        if len(drawn) < count:
            print(f"[data] {category}: the sources give {len(drawn)} distinct prompts, fewer than the {count} the mixture "
                  "weights ask for; the mixture has fewer samples", flush=True)
        prompts.extend(drawn)
    return prompts


def _restated(prompt) -> str:
    """What a prefilled assistant turn says: the prompt's fenced code, or its prose excerpt (every prose
    task template puts the excerpt after the instruction's only blank line)."""
    content = prompt.messages[-1]["content"]
    if prompt.category == "code":
        return content[content.index("```python\n"):content.rindex("```") + 3]
    return content.partition("\n\n")[2]


def prefilled_rows(config: PipelineConfig, tokenizer) -> list[dict]:
    """Code and prose prompts (train split, drawn with their own seed, apart from the regenerated ones)
    answered by restating their code or excerpt; rows shaped like the regenerated dataset's, with
    num_generated 0 (the target wrote none)."""
    from data.chat_masks import build_from_generation, encode, prompt_ids
    from data.sources import iter_prompts

    mixture = config.data.mixture
    rows = []
    for category, count in category_counts(mixture.prefilled_weights, mixture.prefilled_samples).items():
        stream = iter_prompts(category, "train", seed=config.data.seed + 1, max_chars=mixture.max_prompt_tokens * CHARS_PER_TOKEN,
                              heldout_fraction=mixture.heldout_fraction, passes=None)
        for prompt in islice(stream, count):
            ids = prompt_ids(tokenizer, prompt.messages)
            seq = build_from_generation(ids, encode(tokenizer, _restated(prompt)) + [tokenizer.eos_token_id])
            rows.append({"prompt_id": f"prefilled:{prompt.id}", "category": prompt.category, "source": prompt.source,
                         "input_ids": seq.input_ids, "loss_mask": seq.loss_mask, "finished": True,
                         "num_generated": 0, "num_prompt_tokens": len(ids)})
    return rows


def mixture_key(config: PipelineConfig, target_path: Path) -> str:
    from drafters.target_fingerprint import target_fingerprint

    # Settings that do not change the regenerated text stay out of the key (hf: caches made before the
    # backend setting existed keep their key).
    ignored = {"prefilled_samples", "prefilled_weights"} | ({"generation_backend"} if config.data.mixture.generation_backend == "hf" else set())
    settings = {"mixture": config.data.mixture.model_dump(mode="json", exclude=ignored), "seed": config.data.seed,
                "target": target_fingerprint(target_path, config.target.fingerprint)}  # its content, not its path
    compute_dtype = dtype_name(torch_dtype(config.target.dtype))
    if compute_dtype != "bfloat16":  # greedy text differs between dtypes at near-ties; bf16 caches keep their key
        settings["target_dtype"] = compute_dtype
    if config.data.thinking is not None:  # unset: caches made before the setting existed keep their key
        settings["thinking"] = config.data.thinking
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def mixture_dir(config: PipelineConfig, target_path: Path, cache_root: Path) -> Path:
    return Path(cache_root) / "datasets" / f"mixture-{mixture_key(config, target_path)}"


def regenerated_features(config: PipelineConfig, target_path: Path, cache_root: Path, layer_ids: list[int]):
    """The target features regeneration kept for these layers (data/regenerated_features.py), or None."""
    from data.regenerated_features import RegeneratedFeatures, features_dir

    folder = features_dir(mixture_dir(config, target_path, cache_root), layer_ids)
    return RegeneratedFeatures(folder) if folder.is_dir() else None


def greedy_response_spans(config: PipelineConfig, dataset) -> list[tuple[int, int]] | None:
    """Per row of the stage-1 mixture, the positions [lo, hi) whose target greedy choice is the next token:
    a greedily regenerated response is the target's argmax at every step, so training reads those choices
    from the row instead of projecting its final hidden states onto the vocabulary again. Prefilled rows
    (num_generated 0) get an empty span. None: not a greedy regeneration (sampled, a prepared dataset, stage 2)."""
    if config.train.stage != "general" or config.data.dataset is not None or config.data.mixture.temperature > 0:
        return None
    return [(p - 1, p + g - 1) if g else (0, 0)
            for p, g in zip(dataset["num_prompt_tokens"], dataset["num_generated"])]


def build_mixture(config: PipelineConfig, target_path: Path, cache_root: Path,
                  feature_layers: list[int] | None = None) -> Dataset:
    """feature_layers: keep those target layers' features while regenerating, for the feature cache."""
    from data.regenerate import regenerate

    mixture = config.data.mixture
    out_dir = mixture_dir(config, target_path, cache_root)
    prompts = mixture_prompts(config)
    print(f"[data] general mixture: {len(prompts)} prompts -> {out_dir}", flush=True)
    regenerated = regenerate(
        prompts, target_path, out_dir, batch_size=mixture.generation_batch_size, max_new_tokens=mixture.max_new_tokens,
        temperature=mixture.temperature, seed=config.data.seed, max_prompt_tokens=mixture.max_prompt_tokens,
        dtype=config.target.dtype, backend=mixture.generation_backend, feature_layers=feature_layers,
        trust_remote_code=config.target.trust_remote_code, thinking=config.data.thinking,
        fingerprint=config.target.fingerprint,
    )
    if not mixture.prefilled_samples:
        return regenerated
    from data.chat_masks import load_tokenizer

    rows = prefilled_rows(config, load_tokenizer(target_path, trust_remote_code=config.target.trust_remote_code,
                                                 thinking=config.data.thinking))
    print(f"[data] prefilled samples: {len(rows)} ({sum(len(r['input_ids']) for r in rows)} tokens, no decoding)", flush=True)
    return concatenate_datasets([regenerated, Dataset.from_list(rows, features=regenerated.features)])
