"""Regeneration throughput of the testbed target (SmolLM2-135M-Instruct, bf16) on the CPU.

Runs data.regeneration.regenerate.regenerate() end to end (chat template, left-padded batched generation, shards,
final dataset) for each batch size on the same prompts and prints one JSON line:

    python -m bench.bench_regenerate --batch-sizes 8,32 --max-new-tokens 64 --num-prompts 32

tokens_per_second counts the response tokens kept (up to and including EOS) per second of
model.generate() time; wall_seconds also includes model load and writing the dataset.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "merges two sorted lists",
    "counts the words in a text file", "computes the nth Fibonacci number iteratively",
    "removes duplicates from a list while keeping order", "parses a CSV line into fields",
    "flattens a nested list", "returns the longest common prefix of a list of strings",
    "converts a Roman numeral to an integer", "validates an email address with a regex",
    "implements binary search on a sorted list", "transposes a matrix given as a list of lists",
    "groups a list of words by their first letter", "computes the moving average of a list",
    "finds the most frequent element in a list",
]
PROSE_TOPICS = [
    "why the sky is blue", "how vaccines train the immune system", "the causes of the French Revolution",
    "how a bill becomes law", "what photosynthesis does for a plant", "how tides work",
    "why bread rises", "what inflation is", "how bees make honey", "why leaves change colour in autumn",
    "how a rainbow forms", "what a black hole is", "how compound interest works",
    "why we have seasons", "how the internet routes a message", "what causes earthquakes",
]


def bench_prompts(n: int) -> list[dict]:
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            task = CODE_TASKS[(i // 2) % len(CODE_TASKS)]
            prompts.append({"id": f"code-{i}", "category": "code", "source": "bench",
                            "messages": [{"role": "user", "content": f"Write a Python function that {task}."}]})
        else:
            topic = PROSE_TOPICS[(i // 2) % len(PROSE_TOPICS)]
            prompts.append({"id": f"prose-{i}", "category": "prose", "source": "bench",
                            "messages": [{"role": "user", "content": f"Explain {topic} in a short paragraph."}]})
    return prompts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed SmolLM2 target)")
    args = parser.parse_args(argv)

    import torch

    from data.regeneration.regenerate import SUMMARY_FILE, regenerate

    if args.target is None:
        from drafters.target.testbed import prepare_testbed_target

        target = prepare_testbed_target()
    else:
        target = Path(args.target)
    prompts = bench_prompts(args.num_prompts)
    result = {"bench": "regenerate", "target": Path(target).name, "dtype": args.dtype,
              "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
              "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "runs": []}
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            ds = regenerate(prompts, target, tmp, batch_size=bs, max_new_tokens=args.max_new_tokens,
                            temperature=0.0, dtype=args.dtype, max_prompt_tokens=None, progress=False)
            wall = time.perf_counter() - t0
            call = json.loads((Path(tmp) / SUMMARY_FILE).read_text())["this_call"]
        result["runs"].append({
            "batch_size": bs, "response_tokens": call["generated_tokens"],
            "generation_seconds": call["generation_seconds"], "tokens_per_second": call["tokens_per_second"],
            "finished_fraction": round(sum(ds["finished"]) / len(ds), 3), "wall_seconds": round(wall, 2),
        })
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
