"""`python scripts/sglang_gpu_check.py --target TARGET --export EXPORT`: GPU-only entry point; the check lives in
eval/sglang_check.py (serve an export with SGLang, print the acceptance length it measures)."""

from eval.sglang_check import main

if __name__ == "__main__":
    raise SystemExit(main())
