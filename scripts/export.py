"""`python scripts/export.py CKPT OUT --dtype fp8|bf16`: entry point; the code lives in drafters/export.py."""

from drafters.export import main

if __name__ == "__main__":
    raise SystemExit(main())
