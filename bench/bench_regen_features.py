"""Pay once per regenerated token: regeneration that keeps the target features against a second pass.

Side by side, on the same testbed mixture prompts (configs/testbed.yaml's code / prose / chat prompts,
real lengths), each way run in turn `--repeats` times:

- **two passes** (before): `regenerate()`, then `write_feature_cache()` runs the target over every row;
- **one pass**: `regenerate(feature_layers=...)` keeps the features of the forwards it runs anyway, then
  `write_feature_cache()` takes them (`HFCapture.known_features`) and runs the target on nothing.

    python -m bench.bench_regen_features --num-prompts 32 --max-new-tokens 192 --repeats 1

Prints one JSON line: per way, generation seconds, feature-cache seconds, target tokens computed by
the cache, and the total.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from configs.schema import load_config
    from data.feature_cache import write_feature_cache
    from data.sources.mixture import mixture_prompts
    from data.regeneration.regenerate import SUMMARY_FILE, regenerate
    from data.feature_cache.regenerated import RegeneratedFeatures, features_dir
    from drafters.target.capture import HFCapture
    from drafters.drafter.config import build_target_layer_ids
    from drafters.target.testbed import prepare_testbed_target

    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config("configs/testbed.yaml", [f"data.mixture.num_samples={args.num_prompts}"])
    prompts = mixture_prompts(config.data)
    target = prepare_testbed_target()
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16).eval()
    layers = build_target_layer_ids(model.config.num_hidden_layers, config.drafter.num_target_features)
    runs = []
    for repeat in range(args.repeats):
        for way in ("two passes", "one pass"):
            keep = layers if way == "one pass" else None
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                dataset = regenerate(prompts, target, Path(tmp) / "regen", batch_size=args.batch_size,
                                     max_new_tokens=args.max_new_tokens, dtype="bf16",
                                     max_prompt_tokens=config.data.mixture.max_prompt_tokens, progress=False,
                                     feature_layers=keep)
                generation = time.perf_counter() - t0
                call = json.loads((Path(tmp) / "regen" / SUMMARY_FILE).read_text())["this_call"]
                capture = HFCapture(model, layers)
                if keep:
                    capture.known_features = RegeneratedFeatures(features_dir(Path(tmp) / "regen", layers)).lookup
                t1 = time.perf_counter()
                write_feature_cache(dataset, capture, Path(tmp) / "cache", progress=False)
                caching = time.perf_counter() - t1
                capture.remove()
                total_tokens = sum(len(r) for r in dataset["input_ids"])
                runs.append({
                    "way": way, "repeat": repeat, "rows": len(dataset), "row_tokens": total_tokens,
                    "response_tokens": call["generated_tokens"], "generation_seconds": round(generation, 1),
                    "cache_seconds": round(caching, 1), "total_seconds": round(generation + caching, 1),
                    "target_tokens_in_cache_pass": total_tokens if not keep else capture.computed_tokens,
                })
                print(json.dumps(runs[-1]), flush=True)
    result = {"bench": "regen_features", "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "layers": layers, "torch_threads": torch.get_num_threads(), "runs": runs}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
