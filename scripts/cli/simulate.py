"""Simulated agent sessions against the target (simulator/), logged as trajectory files with a summary.

    dflash-pipeline simulate --out DIR --sessions 8 --split train [--server-url URL]
"""

from __future__ import annotations

from pathlib import Path

from simulator.config import LOG_FORMATS, SESSION_SPLITS, SimConfig
from simulator.simulate import simulate, summary_lines


def add_arguments(p) -> None:
    d = SimConfig()
    p.add_argument("--out", type=Path, required=True, help="output folder for the log and its summary")
    p.add_argument("--sessions", type=int, required=True, help="number of main sessions")
    p.add_argument("--split", choices=SESSION_SPLITS, required=True, help="stdlib files the tools may read")
    p.add_argument("--turns", default="-".join(map(str, d.turns)), help="assistant turns per main session: N or A-B")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--subagent-share", type=float, default=d.subagent_share)
    p.add_argument("--subagents", default="-".join(map(str, d.subagents)), help="sub-agents per spawning session")
    p.add_argument("--sub-turns", default="-".join(map(str, d.sub_turns)), help="assistant turns per sub-agent")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--summary-tokens", type=int, default=d.summary_tokens)
    p.add_argument("--tool-tokens", type=int, default=d.tool_tokens, help="token budget of one tool result")
    p.add_argument("--context-cap", type=int, default=d.context_cap, help="compact above this many tokens")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default=d.dtype)
    p.add_argument("--format", choices=tuple(LOG_FORMATS), default=d.format)
    p.add_argument("--tool-role", choices=("tool", "user"), default=d.tool_role)
    p.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction)
    p.add_argument("--name", default=None, help="log file stem (default agentic-<split>-seed<seed>)")
    p.add_argument("--target", type=Path, default=None, help="HF model folder (default: the testbed target)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--server-url", default=None, help="send every request to this OpenAI-compatible server (a vLLM "
                   "server or the log tap in front of one) instead of generating in process")
    p.add_argument("--quiet", action="store_true")


def run(a) -> int:
    config = SimConfig(sessions=a.sessions, split=a.split, seed=a.seed, turns=a.turns,
                       subagent_share=a.subagent_share, subagents=a.subagents, sub_turns=a.sub_turns,
                       max_new_tokens=a.max_new_tokens, summary_tokens=a.summary_tokens, tool_tokens=a.tool_tokens,
                       context_cap=a.context_cap, batch_size=a.batch_size, temperature=a.temperature,
                       dtype=a.dtype, format=a.format, tool_role=a.tool_role,
                       heldout_fraction=a.heldout_fraction, name=a.name)
    result = simulate(config, a.out, a.target, num_threads=a.threads, progress=not a.quiet, server_url=a.server_url)
    print("\n".join(summary_lines(result.summary)))
    print(f"summary: {result.summary_path}")
    return 0
