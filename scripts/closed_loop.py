"""`python scripts/closed_loop.py --out DIR`: serve, log, retrain, promote, serve again, as one command; the code
lives in retraining/closed_loop.py."""

from retraining.closed_loop import main

if __name__ == "__main__":
    raise SystemExit(main())
