"""The built-in corpora of the general mixture (data/sources/builtin.py): counts per category and split, or a
few prompts of one category as JSON lines.

    dflash-pipeline sources [--show code --split heldout -n 3]
"""

from __future__ import annotations

import json

from data.sources.builtin import (
    CATEGORIES,
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_MAX_CHARS,
    SPLITS,
    corpus_stats,
    iter_prompts,
)


def add_arguments(parser) -> None:
    parser.add_argument("--heldout-fraction", type=float, default=DEFAULT_HELDOUT_FRACTION)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS)
    parser.add_argument("--show", choices=CATEGORIES, help="print a few prompts of this category as JSON lines")
    parser.add_argument("--split", choices=SPLITS, default="train")
    parser.add_argument("-n", type=int, default=3)


def run(args) -> int:
    if args.show:
        prompts = iter_prompts(args.show, args.split, args.seed, args.max_chars,
                               heldout_fraction=args.heldout_fraction)
        for _, prompt in zip(range(args.n), prompts):
            print(json.dumps(prompt.to_dict(), ensure_ascii=False))
        return 0
    print(json.dumps(corpus_stats(args.heldout_fraction, args.seed, args.max_chars), indent=2))
    return 0
