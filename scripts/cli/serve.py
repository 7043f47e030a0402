"""A vLLM OpenAI server for a target and a DFlash drafter, managed through a state folder (engines/vllm/server.py).
`restart --drafter {bf16}` is the testbed's `retrain.on_promote`.

    dflash-pipeline serve start --config CONFIG --state-dir DIR [--port 8000] [--drafter DRAFTER]
    dflash-pipeline serve restart|stop|status --state-dir DIR
"""

from __future__ import annotations

import json

from configs.schema import ConfigError, load_config
from engines.vllm.server import (
    ServeError,
    engine_flags,
    make_spec,
    restart,
    start,
    status,
    stop,
)
from scripts.cli.refusal import refuse
from train.setup import resolve_target


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p_start = sub.add_parser("start", help="launch a server and wait until it is healthy")
    p_start.add_argument("--config", default="configs/closed-loop-testbed.yaml",
                         help="its target: block gives the target and the engine settings")
    p_start.add_argument("--port", type=int, default=8000)
    p_start.add_argument("--host", default="127.0.0.1")
    p_start.add_argument("--drafter", default=None, help="drafter folder (default: the target alone)")
    p_start.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. target.path=DIR")
    p_restart = sub.add_parser("restart", help="stop the server (if running) and start it again")
    p_restart.add_argument("--drafter", default=None, help="serve this drafter folder from now on")
    for p in (p_start, p_restart, sub.add_parser("stop"), sub.add_parser("status")):
        p.add_argument("--state-dir", required=True, help="folder with server.json, server.log, serve.jsonl")
    for p in (p_start, p_restart):
        p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for /health")


def run(args) -> int:
    try:
        if args.action == "start":
            config = load_config(args.config, args.overrides)
            target = resolve_target(config, log=lambda *a, **k: None)
            spec = make_spec(target, engine_flags(config.target, target, config.train.seed), args.port, args.host, args.drafter)
            start(args.state_dir, spec, timeout=args.timeout)
        elif args.action == "restart":
            restart(args.state_dir, args.drafter, timeout=args.timeout)
        elif args.action == "stop":
            if not stop(args.state_dir):
                print(f"[serve] no server running for {args.state_dir}")
        else:
            print(json.dumps(status(args.state_dir), indent=2))
    except (ServeError, ConfigError, ValueError) as err:
        return refuse(err, 2)
    return 0
