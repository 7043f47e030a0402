"""What a simulated run looks like: its configuration (SimConfig) and the scripted text of the agent's world
(system prompt, tasks, sub-tasks, the compaction request, tool frequencies)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from data.sources.builtin import DEFAULT_HELDOUT_FRACTION

SESSION_SPLITS = ("train", "heldout")
LOG_FORMATS = {"jsonl.gz": ".jsonl.gz", "jsonl": ".jsonl", "parquet": ".parquet"}
GENERATOR = "scripts.simulate_agentic"
BASE_EPOCH = 1_748_736_000.0  # 2025-06-01T00:00:00Z: simulated timestamps start here
SESSION_SPACING_S = 45.0  # simulated arrival gap between main sessions
TURN_SENTINEL = "\u2063SIMULATOR-TURN-END\u2063"

SYSTEM_PROMPT = (
    "You are CodeAgent, an autonomous coding agent working in a checkout of the CPython standard library "
    "(paths are relative to Lib/). You act in turns: in each turn call exactly one tool, then wait for its "
    "result. Tools:\n"
    "- read_file(path, start, end): show numbered lines of a file\n"
    "- list_dir(path): list a folder\n"
    "- grep(pattern, path): search files for a regular expression\n"
    "- run(command): run a shell command (python -m py_compile, python -m tabnanny, python -m pyclbr, "
    "python -c)\n"
    "- task(description): delegate a sub-task to a sub-agent and receive its report\n"
    'Call a tool as JSON, e.g. {"tool": "read_file", "args": {"path": "json/decoder.py", "start": 1, '
    '"end": 40}}. Be concise. When the task is done, reply with the final answer instead of a tool call.'
)

TASKS = {
    "explain": "Explain what `{name}` in `{path}` does, which inputs it handles and where it is used.",
    "fix": "A user reports that `{name}` in `{path}` misbehaves on empty or unusual input. Investigate, "
           "find the cause and propose a minimal patch.",
    "document": "Write a complete docstring for `{name}` in `{path}` (arguments, return value, errors) and "
                "show the edited code.",
    "test": "Write pytest unit tests for `{name}` in `{path}`, covering normal cases and edge cases.",
    "annotate": "Add precise type hints to `{name}` in `{path}` without changing its behaviour.",
}
SUB_TASKS = (
    "Read `{other}` and report in two sentences how it relates to `{name}` in `{path}`.",
    "Check that `{other}` compiles cleanly and summarise its structure for the main agent.",
    "Search `{folder}` for uses of `{short}` and list the most relevant call sites.",
)
COMPACT_PROMPT = (
    "[context limit reached] Summarise the conversation so far in a few sentences: the task, what you "
    "found, and what remains to be done. The earlier turns will be replaced by your summary."
)
TOOL_WEIGHTS = {"read_file": 0.35, "run": 0.3, "grep": 0.15, "list_dir": 0.1, "read_other": 0.1}
RUN_KINDS = ("py_compile", "tabnanny", "outline", "pyclbr")


def parse_range(value: str | int | Sequence[int]) -> tuple[int, int]:
    """``"6-8"`` -> (6, 8); ``"6"`` / 6 -> (6, 6); (a, b) passes through. Both ends inclusive, >= 0."""
    if isinstance(value, int):
        lo = hi = value
    elif isinstance(value, str):
        parts = value.strip().split("-")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"expected N or A-B, got {value!r}")
        lo, hi = int(parts[0]), int(parts[-1])
    else:
        lo, hi = (int(v) for v in value)
    if lo < 0 or hi < lo:
        raise ValueError(f"invalid range {value!r}")
    return lo, hi


@dataclass
class SimConfig:
    """Shape of a simulated run. Defaults: the published agentic statistics scaled down to the CPU."""

    sessions: int = 4  # main sessions
    split: str = "train"  # "train" or "heldout": which stdlib files the tools may read
    seed: int = 0
    turns: tuple[int, int] = (6, 8)  # assistant turns per main session (published median 43)
    subagent_share: float = 0.44  # fraction of main sessions that spawn sub-agents (published 44%)
    subagents: tuple[int, int] = (1, 2)  # sub-agents per spawning session (published median 4)
    sub_turns: tuple[int, int] = (2, 4)  # assistant turns per sub-agent
    max_new_tokens: int = 64  # per assistant turn (published output median 444; short outputs)
    summary_tokens: int = 64  # new tokens of a compaction summary
    tool_tokens: int = 256  # budget of one tool result (a few hundred tokens)
    context_cap: int = 1536  # prompt + new tokens above this triggers compaction
    batch_size: int = 8
    temperature: float = 0.0  # 0 = greedy
    dtype: str = "auto"  # bf16 where the hardware multiplies it natively, else float32
    format: str = "jsonl.gz"
    tool_role: str = "tool"  # role of tool-result messages ("tool" or "user")
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
    name: str | None = None  # log file stem; default agentic-<split>-seed<seed>
    system_prompt: str = SYSTEM_PROMPT  # the agent's system prompt (tests use a shorter one)

    def __post_init__(self) -> None:
        self.turns = parse_range(self.turns)
        self.subagents = parse_range(self.subagents)
        self.sub_turns = parse_range(self.sub_turns)
        if self.split not in SESSION_SPLITS:
            raise ValueError(f"split must be one of {SESSION_SPLITS}, got {self.split!r}")
        if self.sessions < 1 or self.turns[0] < 1 or self.sub_turns[0] < 1:
            raise ValueError("sessions, turns and sub_turns must be >= 1")
        if not 0.0 <= self.subagent_share <= 1.0:
            raise ValueError("subagent_share must be in [0, 1]")
        if min(self.max_new_tokens, self.summary_tokens, self.tool_tokens, self.batch_size) < 1:
            raise ValueError("max_new_tokens, summary_tokens, tool_tokens and batch_size must be >= 1")
        if self.format not in LOG_FORMATS:
            raise ValueError(f"format must be one of {tuple(LOG_FORMATS)}")
        if self.tool_role not in ("tool", "user"):
            raise ValueError("tool_role must be 'tool' or 'user'")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")

    @property
    def stem(self) -> str:
        return self.name or f"agentic-{self.split}-seed{self.seed}"


def log_path(out_dir: str | os.PathLike, config: SimConfig) -> Path:
    return Path(out_dir) / f"{config.stem}{LOG_FORMATS[config.format]}"


def summary_path(out_dir: str | os.PathLike, config: SimConfig) -> Path:
    return Path(out_dir) / f"{config.stem}.summary.json"
