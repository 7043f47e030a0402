"""Embedded CPU testbed: convert and verify the real SmolLM2-135M-Instruct target (drafters/target/testbed.py) and
print its folder.

    dflash-pipeline testbed [--cache-dir DIR] [--force]
"""

from __future__ import annotations

from pathlib import Path

from drafters.target.testbed import prepare_testbed_target


def add_arguments(parser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $DFLASH_CACHE or ~/.cache/dflash-pipeline")
    parser.add_argument("--force", action="store_true", help="convert again even if a verified folder exists")


def run(args) -> int:
    try:
        path = prepare_testbed_target(args.cache_dir, force=args.force)
    except RuntimeError as err:
        raise SystemExit(f"error: {err}") from None
    print(path)
    return 0
