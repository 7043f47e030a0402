"""`dflash-pipeline export ...` is `dflash-pipeline export ...` (scripts/cli/export.py)."""

import sys

from scripts.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
