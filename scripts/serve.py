"""`python scripts/serve.py start|restart|stop|status --state-dir DIR`: entry point; the code lives in
eval/serve.py (`restart --drafter {bf16}` is the testbed's `retrain.on_promote`)."""

from eval.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
