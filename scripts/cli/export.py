"""Export a trained drafter to a folder SGLang (DFLASH), vLLM (dflash) and the z-lab reference load
(drafters/export/exporter.py), then with --serving-check serve it in vLLM and hold it to the eval (eval/engine.py).

    dflash-pipeline export CKPT OUT --dtype fp8|bf16 [--serving-check]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from drafters.export.contract import ContractError
from drafters.export.exporter import EXPORT_DTYPES, export_drafter
from eval.engine import serving_check, serving_check_config
from eval.report import model_card_info


def add_arguments(parser) -> None:
    parser.add_argument("ckpt", type=Path, help="drafter folder, or a training checkpoint holding drafter/")
    parser.add_argument("out", type=Path, help="export folder to create")
    parser.add_argument("--dtype", choices=EXPORT_DTYPES, required=True)
    parser.add_argument("--model-card-info", default=None,
                        help="JSON object or JSON file: target, data, tau {category: value}, with_lookup {...}, "
                             "prompt_lookup {...}; or an eval report.json (its first drafter's figures)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export at OUT")
    parser.add_argument("--allow-unaligned", action="store_true",
                        help="write an FP8 export even if its widths are not multiples of 128 (not servable by SGLang)")
    parser.add_argument("--allow-remote-code-source", action="store_true",
                        help="export a source whose config.json asks for remote code (auto_map, trust_remote_code); "
                             "the export drops those settings")
    parser.add_argument("--serving-check", action="store_true",
                        help="then serve the export in vLLM and check it against the eval (eval/engine.py)")
    parser.add_argument("--target", default=None, help="serving check: target folder (default: the testbed target)")
    parser.add_argument("--check-traces", default="code,prose", help="serving check: trace categories")
    parser.add_argument("--trajectories", action="append", default=[], help="serving check: agent sessions (ids)")


def card_info(value: str | None):
    """--model-card-info as given, or the figures of an eval report.json."""
    if value is None or value.lstrip().startswith("{") or not Path(value).is_file():
        return value
    given = json.loads(Path(value).read_text())
    return model_card_info(given) if isinstance(given, dict) and {"categories", "methods"} <= set(given) else value


def run(args) -> int:
    try:
        summary = export_drafter(args.ckpt, args.out, args.dtype, card_info(args.model_card_info),
                                 overwrite=args.overwrite, allow_unaligned=args.allow_unaligned,
                                 allow_remote_code_source=args.allow_remote_code_source)
    except (ContractError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"export refused: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    if not args.serving_check:
        return 0
    config = serving_check_config(args.out.parent / f"serving-check-{args.out.name}", args.target,
                                  categories=args.check_traces.split(","), trajectories=args.trajectories)
    return 0 if serving_check(args.out, config)["passed"] else 1
