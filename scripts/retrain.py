"""`python scripts/retrain.py --config CONFIG`: entry point; the code lives in retraining/."""

from retraining.cycle import main

if __name__ == "__main__":
    raise SystemExit(main())
