"""`python -m scripts.testbed [--cache-dir DIR] [--force]`: entry point; the code lives in drafters/testbed.py."""

from drafters.testbed import main

if __name__ == "__main__":
    raise SystemExit(main())
