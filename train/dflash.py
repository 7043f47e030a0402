"""`accelerate launch train/dflash.py --config configs/testbed.yaml [section.key=value ...]`: the train verb of the
command line (scripts/cli/train.py); the training loop is train/loop.py."""

import sys

from scripts.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
