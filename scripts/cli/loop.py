"""The closed loop as one command on the testbed (retraining/closed_loop.py): serve, log, retrain, promote, serve
again. Exit status 0 when v1 beats v0 by the promotion margin on the held-out requests.

    dflash-pipeline loop --out outputs/closed-loop [--config configs/closed-loop-testbed.yaml] [key=value ...]
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from configs.schema import ConfigError
from retraining.closed_loop import V0_OVERRIDES, LoopError, LoopSettings, run_loop
from scripts.cli.refusal import refuse


def add_arguments(parser) -> None:
    d = LoopSettings(out=Path("outputs/closed-loop"))
    parser.add_argument("--out", type=Path, default=d.out, help="work folder (report.json, state/, serve/, ...)")
    parser.add_argument("--config", default=d.config, help="the loop's pipeline config (engine block, retrain section)")
    parser.add_argument("--v0-config", default=d.v0_config, help="v0's training config (train/dflash.py)")
    parser.add_argument("--v0-set", action="append", default=None, metavar="KEY=VALUE",
                        help=f"v0's training overrides (repeatable; default: {' '.join(V0_OVERRIDES)})")
    parser.add_argument("--train-sessions", type=int, default=d.train_sessions)
    parser.add_argument("--heldout-sessions", type=int, default=d.heldout_sessions)
    parser.add_argument("--train-seed", type=int, default=d.train_seed)
    parser.add_argument("--heldout-seed", type=int, default=d.heldout_seed)
    parser.add_argument("--turns", default=d.turns, help="assistant turns per session: N or A-B")
    parser.add_argument("--subagent-share", type=float, default=d.subagent_share)
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--tool-tokens", type=int, default=d.tool_tokens)
    parser.add_argument("--context-cap", type=int, default=d.context_cap)
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="simulated requests in flight at once")
    parser.add_argument("--server-port", type=int, default=0)
    parser.add_argument("--tap-port", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the loop's config, e.g. target.path=DIR")


def run(args) -> int:
    settings = LoopSettings(
        out=args.out, config=args.config, overrides=args.overrides, v0_config=args.v0_config,
        v0_overrides=args.v0_set if args.v0_set is not None else list(V0_OVERRIDES),
        train_sessions=args.train_sessions, heldout_sessions=args.heldout_sessions, train_seed=args.train_seed,
        heldout_seed=args.heldout_seed, turns=args.turns, subagent_share=args.subagent_share,
        max_new_tokens=args.max_new_tokens, tool_tokens=args.tool_tokens, context_cap=args.context_cap,
        concurrency=args.concurrency, server_port=args.server_port, tap_port=args.tap_port)
    # SIGTERM unwinds like Ctrl-C, so that the server (in its own session) and the tap are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        report = run_loop(settings)
    except (ConfigError, LoopError, ValueError, FileNotFoundError) as err:
        return refuse(err, 2)
    return 0 if report["v1_beats_v0_by_margin"] else 1
