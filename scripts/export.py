"""`python scripts/export.py CKPT OUT --dtype fp8|bf16 [--serving-check]`: entry point; the export lives in
drafters/export.py, the vLLM serving check in eval/engine.py."""

from eval.engine import export_main

if __name__ == "__main__":
    raise SystemExit(export_main())
