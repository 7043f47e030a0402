"""Serving check of a drafter export in vLLM: greedy outputs equal the target's, tau within 2% of the eval's
(eval/engine.py).

    dflash-pipeline serving-check EXPORT [--target TARGET] [--traces code,prose,agentic --trajectories DIR]
"""

from __future__ import annotations

from pathlib import Path

from eval.engine import serving_check, serving_check_config


def add_arguments(parser) -> None:
    parser.add_argument("export", help="export folder (`dflash-pipeline export`) or any reference-format drafter folder")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed target)")
    parser.add_argument("--traces", default="code,prose")
    parser.add_argument("--trajectories", action="append", default=[], help="agent sessions (ids) for --traces agentic")
    parser.add_argument("--max-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="default: EXPORT/../serving-check-NAME")


def run(args) -> int:
    out = args.out or str(Path(args.export).parent / f"serving-check-{Path(args.export).name}")
    config = serving_check_config(out, args.target, categories=args.traces.split(","), trajectories=args.trajectories,
                                  max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens)
    return 0 if serving_check(args.export, config)["passed"] else 1
