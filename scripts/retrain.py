"""`dflash-pipeline retrain ...` is `dflash-pipeline retrain ...` (scripts/cli/retrain.py)."""

import sys

from scripts.cli import main

if __name__ == "__main__":
    sys.exit(main(["retrain", *sys.argv[1:]]))
