"""The log tap (data/tap/proxy.py): an async proxy in front of an OpenAI-compatible vLLM or SGLang server that logs
every answered request's token ids as trajectory records (data/TRAJECTORY_FORMAT.md). Needs the `tap` extra.

    dflash-pipeline tap --upstream http://127.0.0.1:8000 --port 8100 --out /mnt/logs/incoming
"""

from __future__ import annotations

from data.tap.proxy import ID_FLAGS, TapSettings, serve_tap


def add_arguments(parser) -> None:
    parser.add_argument("--upstream", required=True, help="the engine's server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--out", required=True, help="folder for the trajectory logs")
    parser.add_argument("--upstream-kind", choices=tuple(ID_FLAGS), default="vllm")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the upstream")
    parser.add_argument("--max-body-bytes", type=int, default=32 << 20)
    parser.add_argument("--segment-records", type=int, default=10_000, help="records per closed log file")
    parser.add_argument("--retention-days", type=float, default=None, help="delete closed logs older than this")
    parser.add_argument("--quota-gb", type=float, default=None, help="delete the oldest closed logs above this")
    parser.add_argument("--graceful-seconds", type=float, default=60.0, help="SIGTERM: wait this long for requests in flight")


def run(args) -> int:
    settings = TapSettings(upstream=args.upstream, out_dir=args.out, upstream_kind=args.upstream_kind,
                           timeout=args.timeout, max_body_bytes=args.max_body_bytes,
                           segment_records=args.segment_records, retention_days=args.retention_days,
                           quota_gb=args.quota_gb)
    print(f"[log-tap] http://{args.host}:{args.port} -> {args.upstream} ({args.upstream_kind}); logs under {args.out}",
          flush=True)
    serve_tap(settings, args.host, args.port, args.graceful_seconds)
    return 0
