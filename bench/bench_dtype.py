"""bf16 against fp32 on this machine, and what `dtype: auto` / `train.dtype: auto` choose here.

    python -m bench.bench_dtype [--threads 2]

Times, in each dtype, the matmul at the lm_head's shape (256 rows x 576 x 49,152), the testbed target's
prefill (1 x 512 tokens) and one decode step at regeneration's batch (32 rows, 256 cached tokens). The
drafter's training step in both dtypes is bench/bench_drafter.py. Run it on an otherwise idle machine:
both dtypes run in one process, one after the other. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from bench.bench_drafter import timed
from common.dtypes import NATIVE_BF16_CPU_FLAGS, cpu_flags, native_bf16, torch_dtype


def bench(dtype: torch.dtype, model_path, reps: int) -> dict:
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    rows, weight = torch.randn(256, 576, generator=g).to(dtype), torch.randn(49152, 576, generator=g).to(dtype)
    matmul_s = timed(lambda: rows @ weight.T, reps)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()
    prompt = torch.randint(100, 40000, (1, 512), generator=g)
    batch = torch.randint(100, 40000, (32, 256), generator=g)
    with torch.inference_mode():
        prefill_s = timed(lambda: model(input_ids=prompt), reps)
        cache = model(input_ids=batch, use_cache=True).past_key_values
        step = torch.randint(100, 40000, (32, 1), generator=g)

        def decode():
            model(input_ids=step, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # every rep decodes after the same 256 tokens

        decode_s = timed(decode, reps * 3)
    return {"lm_head_matmul_gflops": round(2 * 256 * 576 * 49152 / matmul_s / 1e9, 1),
            "prefill_512_tok_s": round(512 / prefill_s, 1),
            "decode_batch32_tok_s": round(32 / decode_s, 1)}


def main() -> None:
    from drafters.target.testbed import prepare_testbed_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = prepare_testbed_target()
    out = {"bench": "dtype", "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "native_bf16_flags": sorted(cpu_flags() & set(NATIVE_BF16_CPU_FLAGS)), "native_bf16": native_bf16("cpu"),
           "auto": str(torch_dtype("auto")).removeprefix("torch."), "torch": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        out[str(dtype).removeprefix("torch.")] = bench(dtype, folder, args.reps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
