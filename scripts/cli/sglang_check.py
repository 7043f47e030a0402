"""GPU only: serve an FP8 (or bf16) export with SGLang and print the acceptance length it measures
(engines/sglang/check.py). Not run by the tests: this machine has no GPU.

    dflash-pipeline sglang-check --target TARGET --export EXPORT [--prompts 8] [--max-new-tokens 256] [--tp 8]
"""

from __future__ import annotations

import json

from engines.sglang.check import SGLangCheckError, sglang_tau
from scripts.cli.refusal import refuse


def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True)
    parser.add_argument("--export", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--tp", type=int, default=1, help="--tp-size for the target (Kimi: 8)")
    parser.add_argument("--startup-timeout", type=float, default=1800)


def run(args) -> int:
    try:
        print(json.dumps(sglang_tau(args.target, args.export, args.prompts, args.max_new_tokens, args.tp,
                                    args.startup_timeout)))
    except SGLangCheckError as err:
        return refuse(err, 1 if "installed" not in str(err) else 2)
    return 0
