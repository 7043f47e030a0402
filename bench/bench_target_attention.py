"""Batched generation with grouped-query attention (drafters/target/attention.py) against a baseline.

Regeneration's own work, side by side: the testbed mixture's prompts (configs/testbed.yaml, real lengths, sorted
by length as `regenerate` sorts them), the target in `--dtype` (fp32 by default), batches of `--batch-size`
left-padded prompts, greedy, the drafter's target layers kept from every forward. Each batch runs once per
attention, alternating which goes first, so both see the same load. Baselines (`--baseline`):
- `sdpa`: transformers' own, which repeats the key/value heads under a padding mask;
- `kernel`: grouped-query SDPA with torch's kernel at every step, batched decoding steps included (the grouped
  attention before its one-query path and its decoding cache);
- `cache`: the same grouped attention with the library's cache, which concatenates bf16 keys and values at every
  step, against `decoding_cache`'s buffers with fp32 keys;
- `head`: the same target whose vocabulary projection takes the prefill's strided last row as it comes
  (drafters/target/loading.py `contiguous_head_input` undone).

    python -m bench.bench_target_attention --num-prompts 64 --batch-size 32 --max-new-tokens 192
    python -m bench.bench_target_attention --baseline kernel --dtype bf16 --batch-size 64
    python -m bench.bench_target_attention --baseline cache --dtype bf16 --batch-size 64
    python -m bench.bench_target_attention --baseline head --dtype bf16 --batch-size 64

Prints one JSON line: per attention, generation seconds and response columns per second, and whether the two
gave the same tokens and features.
"""

from __future__ import annotations

import argparse
import json
import time


def _batches(config, batch_size: int, tokenizer, context: int | None) -> list[list[list[int]]]:
    """The mixture's prompts as regeneration screens and sorts them (data.regeneration.regenerate's own rules)."""
    from data.sources.mixture import mixture_prompts
    from data.regeneration.regenerate import regeneration_order

    mixture = config.data.mixture
    ids = regeneration_order(mixture_prompts(config.data), tokenizer, mixture.max_prompt_tokens, mixture.max_new_tokens,
                             context)
    return [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]


def _register_kernel_everywhere() -> str:
    """Grouped-query SDPA whose every step, one query or many, goes through torch's kernel."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return output.transpose(1, 2).contiguous(), None

    AttentionInterface.register("sdpa_gqa_kernel", forward)
    AttentionMaskInterface.register("sdpa_gqa_kernel", sdpa_mask)
    return "sdpa_gqa_kernel"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--dtype", default="fp32", help="the target's dtype: fp32 or bf16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--baseline", choices=["sdpa", "kernel", "cache", "head"], default="sdpa")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from common import dtypes
    from configs.schema import load_config
    from drafters.target.chat import load_tokenizer
    from engines.hf.generation import BatchGenerator
    from drafters.target.capture import HFCapture
    from drafters.drafter.config import build_target_layer_ids
    from drafters.target.attention import use_on_cpu
    from drafters.target.loading import load_target_model
    from drafters.target.testbed import prepare_testbed_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = prepare_testbed_target()
    tokenizer = load_tokenizer(target)
    dtype = dtypes.torch_dtype(args.dtype)
    if args.baseline == "head":  # the loader's model without contiguous_head_input
        baseline = use_on_cpu(AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype)).eval()
    else:
        baseline = load_target_model(target, dtype=dtype)
    models = {args.baseline: baseline, "grouped": load_target_model(target, dtype=dtype)}
    if args.baseline in ("sdpa", "kernel"):
        attention = "sdpa" if args.baseline == "sdpa" else _register_kernel_everywhere()
        models[args.baseline].set_attn_implementation(attention)
    config = load_config("configs/testbed.yaml", [f"data.mixture.num_samples={args.num_prompts}",
                                                  f"data.mixture.max_new_tokens={args.max_new_tokens}"])
    target_config = models["grouped"].config
    layers = build_target_layer_ids(target_config.num_hidden_layers, config.drafter.num_target_features)
    seconds = {name: 0.0 for name in models}
    columns, same_tokens, feature_diff = 0, True, 0.0
    for i, batch in enumerate(_batches(config, args.batch_size, tokenizer,
                                               getattr(target_config, "max_position_embeddings", None))):
        outputs = {}
        for name in (list(models) if i % 2 == 0 else list(models)[::-1]):
            generator = BatchGenerator(models[name], tokenizer, 0.0, 0, buffered_cache=name != "cache")
            tap = HFCapture(models[name], layers)
            started = time.perf_counter()
            outputs[name] = generator.generate_with_features(batch, args.max_new_tokens, [str(i)] * len(batch), tap)
            seconds[name] += time.perf_counter() - started
            tap.remove()
        (tokens_a, features_a), (tokens_b, features_b) = outputs[args.baseline], outputs["grouped"]
        same_tokens &= tokens_a == tokens_b
        columns += len(batch) * len(tokens_a[0])
        if features_a.selected.shape != features_b.selected.shape:
            feature_diff = None  # different lengths: same_tokens is False, and no difference is defined
        elif feature_diff is not None:
            feature_diff = max(feature_diff, (features_a.selected - features_b.selected).abs().max().item())
    result = {"bench": "target_attention", "baseline": args.baseline, "dtype": str(dtype), "torch_threads": torch.get_num_threads(),
              "num_prompts": args.num_prompts, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
              "columns": columns,
              "runs": {name: {"generation_seconds": round(s, 1), "columns_per_second": round(columns / s, 1)}
                       for name, s in seconds.items()},
              "speedup": round(seconds[args.baseline] / seconds["grouped"], 2),
              "same_tokens": same_tokens, "max_feature_difference": feature_diff}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
