"""The pipeline's one command line: `dflash-pipeline VERB [...]` (or `python -m scripts.cli VERB [...]`).

    dflash-pipeline prepare --config configs/testbed.yaml        sources -> regeneration -> features (train/prepare.py)
    dflash-pipeline train --config configs/testbed.yaml          the same as `accelerate launch train/dflash.py ...`
    dflash-pipeline plan --config configs/kimi-k2.6.yaml         memory per GPU, bytes and hours, before renting
    dflash-pipeline eval --drafter outputs/testbed               acceptance length by real speculative decoding
    dflash-pipeline export outputs/testbed exports/testbed-fp8 --dtype fp8
    dflash-pipeline retrain --config configs/retrain-testbed.yaml
    dflash-pipeline tap --upstream http://127.0.0.1:8000 --out logs/incoming
    dflash-pipeline simulate --out logs/sim --sessions 8 --split train

Each verb's arguments live in its own module here (scripts/cli/<verb>.py: `add_arguments` and `run`), and each
calls its stage's library; `dflash-pipeline VERB --help` lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> (module under scripts.cli, one line of help)
VERBS = {
    "prepare": ("prepare", "build a run's data: the dataset, then the offline feature cache (this process's share)"),
    "train": ("train", "train a drafter (launch with accelerate for several processes)"),
    "plan": ("plan", "plan a run: memory per GPU, feature bytes, regeneration, capture and training time"),
    "eval": ("evaluate", "acceptance length (tau) of drafters by real speculative decoding"),
    "export": ("export", "export a drafter for SGLang, vLLM and the z-lab reference (bf16 or FP8)"),
    "serving-check": ("serving_check", "serve an export in vLLM and check it against the eval"),
    "sglang-check": ("sglang_check", "GPU only: serve an export with SGLang and print its acceptance length"),
    "retrain": ("retrain", "one continuous-retraining cycle, or --bootstrap, --status, --rollback, --notify"),
    "loop": ("loop", "the closed loop on the testbed: serve, log, retrain, promote, serve again"),
    "serve": ("serve", "start, restart, stop or show a vLLM server for a target and a drafter"),
    "tap": ("tap", "the log tap: a proxy in front of a vLLM or SGLang server that logs token ids"),
    "simulate": ("simulate", "simulated agent sessions against the target, logged as trajectories"),
    "testbed": ("testbed", "convert and verify the embedded testbed target"),
    "fingerprint": ("fingerprint", "a target folder's content fingerprint, or write its sidecar"),
    "sources": ("sources", "the built-in corpora: counts per category and split, or sample prompts"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dflash-pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    if argv and argv[0] in VERBS:  # import only the verb asked for: each pulls in its stage's dependencies
        chosen = [argv[0]]
    else:
        chosen = []
        for verb, (_, summary) in VERBS.items():
            verbs.add_parser(verb, help=summary)
    for verb in chosen:
        module = importlib.import_module(f"scripts.cli.{VERBS[verb][0]}")
        sub = verbs.add_parser(verb, help=VERBS[verb][1], description=module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    return args.run(args) or 0
