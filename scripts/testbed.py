"""`dflash-pipeline testbed ...` is `dflash-pipeline testbed ...` (scripts/cli/testbed.py)."""

import sys

from scripts.cli import main

if __name__ == "__main__":
    sys.exit(main(["testbed", *sys.argv[1:]]))
