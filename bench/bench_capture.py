"""Target feature capture on SmolLM2-135M at 2K-token sequences: forward hooks vs output_hidden_states.

  python bench/bench_capture.py [--tokens 2048] [--dtype bf16] [--reps 3]

Variants, each in a fresh subprocess (so one variant's allocations cannot hide another's peak):
  hooks             HFCapture: decoder only, keeps the 5 chosen layers + the final norm output.
  hooks_no_final    HFCapture(with_final=False): stops after layer 27 of 30 (no KL targets).
  hidden_states     decoder with output_hidden_states=True (all 31 states kept), no lm_head.
  causal_lm_hidden  the full CausalLM forward with output_hidden_states=True (+ full-vocab logits), what
                    the reference decoder does.
Peak memory: the process's peak RSS (VmHWM) is reset after loading, before the first forward, so
`peak_rss_over_loaded_mb` is what one forward adds on top of the loaded model (its outputs included). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LAYER_IDS = [1, 8, 14, 20, 27]
VARIANTS = ("hooks", "hooks_no_final", "hidden_states", "causal_lm_hidden")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def run_variant(variant: str, tokens: int, dtype_name: str, reps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from drafters.target.capture import HFCapture
    from drafters.target.testbed import prepare_testbed_target

    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(prepare_testbed_target(), dtype=dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    capture = HFCapture(model, LAYER_IDS)

    @torch.no_grad()
    def once():
        if variant.startswith("hooks"):
            out = capture.capture(ids, with_final=variant == "hooks")
            return out.selected, out.final_hidden
        if variant == "hidden_states":
            hs = model.model(ids, output_hidden_states=True).hidden_states
        else:
            hs = model(ids, output_hidden_states=True).hidden_states
        return torch.cat([hs[i + 1] for i in LAYER_IDS], -1), hs[-1]

    loaded_mb = _status_kb("VmRSS") / 1024
    reset = _reset_peak_rss()
    once()  # also the warm-up
    peak_mb = _status_kb("VmHWM") / 1024
    start = time.perf_counter()
    for _ in range(reps):
        once()
    seconds = (time.perf_counter() - start) / reps
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "seconds_per_seq": round(seconds, 3),
        "loaded_rss_mb": round(loaded_mb, 1),
        "peak_rss_mb": round(peak_mb, 1),
        "peak_rss_over_loaded_mb": round(peak_mb - loaded_mb, 1) if reset else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.tokens, args.dtype, args.reps)))
        return
    import torch

    out = {"bench": "capture", "target": "SmolLM2-135M-Instruct", "tokens": args.tokens, "dtype": args.dtype,
           "layer_ids": LAYER_IDS, "threads": torch.get_num_threads()}
    for variant in VARIANTS:
        child = subprocess.run(
            [sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens), "--dtype", args.dtype,
             "--reps", str(args.reps)],
            capture_output=True, text=True, check=True,
        )
        out[variant] = json.loads(child.stdout.strip().splitlines()[-1])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
