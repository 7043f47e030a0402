"""Held-out evaluation traces: the prompts each category is decoded on, as token ids.

* ``code`` / ``prose`` (and ``chat``: held-out MT-Bench / ChatterBot questions, no document excerpt in
  the prompt; available from the CLI, not in ``EvalConfig.categories``): single-turn chat prompts built
  from HELD-OUT documents only
  (``data.sources.builtin.iter_prompts(category, split="heldout")``; no held-out document, and no near-duplicate
  in its split group, is ever trained on), rendered with the target's chat template
  (``drafters.target.chat.prompt_ids``: the ids the target sees before it starts answering).
* ``agentic``: logged coding-agent requests (``data/TRAJECTORY_FORMAT.md``: JSONL, JSONL.gz or Parquet,
  files or folders) read with ``data.trajectory.reader.load_trajectories``. A prompt is a request's
  ``input_ids`` (the whole session context the target saw) and the target continues with the next turn.
  By default the LAST request of each session is taken (the longest context, ``per_session`` > 1 takes
  the last few), sessions in order of first appearance.
  The log must be held out from the drafter's fine-tuning data (e.g. ``dflash-pipeline simulate``'s
  held-out sessions); this module cannot check that, it only reads ids.

Limits, per category: at most ``max_prompts`` prompts, and at most ``max_tokens`` tokens in total, counted
as prompt tokens + ``max_new_tokens`` per prompt (prompts are taken in order while they fit; a prompt that
alone exceeds the budget is skipped and counted). A prompt that does not fit the target's context window
with ``max_new_tokens`` more tokens is skipped and counted too.

An empty trace source (empty file or folder, every record quarantined, a category with no held-out
prompt, or a budget that leaves none) raises :class:`TraceError`: a category is never reported with zero
prompts.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from data.sources.builtin import iter_prompts
from data.trajectory.reader import expand_paths, load_trajectories
from drafters.target.chat import prompt_ids

HELDOUT_CATEGORIES = ("code", "prose", "chat", "writing")
CATEGORIES = ("code", "prose", "agentic", "chat", "writing")  # configs.schema.EvalConfig.categories: the same five


class TraceError(ValueError):
    """A category that yields no prompt to evaluate on (an error, never reported as a zero)."""


@dataclass
class Trace:
    """One evaluation prompt: ``input_ids`` is what the target sees before it starts answering."""

    id: str
    category: str
    input_ids: list[int]
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class TraceSet:
    category: str
    traces: list[Trace]
    source: str                       # where the prompts came from, in words
    skipped_budget: int = 0           # prompts dropped by max_tokens
    skipped_context: int = 0          # prompts that do not fit the context window
    ingest: dict | None = None        # agentic: the trajectory ingestion summary

    @property
    def prompt_tokens(self) -> int:
        return sum(t.num_tokens for t in self.traces)

    def describe(self) -> dict:
        return {"category": self.category, "source": self.source, "prompts": len(self.traces),
                "prompt_tokens": self.prompt_tokens, "skipped_budget": self.skipped_budget,
                "skipped_context": self.skipped_context, "ingest": self.ingest,
                "ids": [t.id for t in self.traces]}


def _take(candidates, category: str, max_prompts: int, max_tokens: int | None, max_new_tokens: int,
          max_positions: int | None, source: str) -> TraceSet:
    """Take traces in order under the prompt and token budgets."""
    out = TraceSet(category, [], source)
    used = 0
    for trace in candidates:
        if len(out.traces) >= max_prompts:
            break
        cost = trace.num_tokens + max_new_tokens
        if max_positions is not None and cost > max_positions:
            out.skipped_context += 1
            continue
        if max_tokens is not None and used + cost > max_tokens:
            out.skipped_budget += 1
            if cost > max_tokens:
                continue  # this one never fits; a shorter one may
            break         # budget spent
        used += cost
        out.traces.append(trace)
    if not out.traces:
        why = []
        if out.skipped_budget:
            why.append(f"{out.skipped_budget} prompt(s) exceed --max-tokens {max_tokens} "
                       f"(prompt tokens + max_new_tokens {max_new_tokens})")
        if out.skipped_context:
            why.append(f"{out.skipped_context} prompt(s) do not fit the target's context window of {max_positions} "
                       f"positions with {max_new_tokens} new tokens")
        raise TraceError(f"category {category!r} has zero prompts to evaluate ({source})"
                         + (": " + "; ".join(why) if why else ""))
    return out


def heldout_traces(category: str, tokenizer, *, max_prompts: int, max_new_tokens: int,
                   max_tokens: int | None = None, seed: int = 0, max_chars: int = 2000,
                   max_positions: int | None = None, chat_template: str | None = None) -> TraceSet:
    """Code or prose prompts from held-out documents, chat-template rendered."""
    if category not in HELDOUT_CATEGORIES:
        raise ValueError(f"held-out traces exist for {HELDOUT_CATEGORIES}, not {category!r}")
    if tokenizer is None:
        raise TraceError(f"category {category!r} needs the target's tokenizer (chat template) and the target has none; "
                         "evaluate on --traces agentic instead")

    def candidates():
        for prompt in iter_prompts(category, split="heldout", seed=seed, max_chars=max_chars):
            ids = prompt_ids(tokenizer, prompt.messages, chat_template=chat_template)
            yield Trace(prompt.id, category, [int(i) for i in ids],
                        {"task": prompt.task, "source": prompt.source, "document_id": prompt.document_id})

    source = f"held-out {category} documents (data.sources.builtin split='heldout', seed {seed}, max_chars {max_chars})"
    # Bound the scan: a tight token budget should not tokenize the whole held-out corpus.
    limited = itertools.islice(candidates(), max(4 * max_prompts, max_prompts + 64))
    return _take(limited, category, max_prompts, max_tokens, max_new_tokens, max_positions, source)


def agentic_traces(paths, vocab_size: int, *, max_prompts: int, max_new_tokens: int,
                   max_tokens: int | None = None, per_session: int = 1, max_positions: int | None = None,
                   quarantine_path: str | Path | None = None) -> TraceSet:
    """Logged agent requests as prompts: the last ``per_session`` requests of each session."""
    if paths is None or (isinstance(paths, (list, tuple)) and not paths):
        raise TraceError("category 'agentic' needs --trajectories FILE_OR_DIR (held-out agent sessions as token ids)")
    if per_session < 1:
        raise ValueError(f"per_session must be >= 1, got {per_session}")
    files = expand_paths(paths)  # FileNotFoundError for a missing path
    shown = ", ".join(str(p) for p in (paths if isinstance(paths, (list, tuple)) else [paths]))
    if not files:
        raise TraceError(f"category 'agentic': no trajectory file (*.jsonl, *.jsonl.gz, *.parquet) under {shown}")
    records, summary = load_trajectories(files, vocab_size, quarantine_path=quarantine_path)
    ingest = summary.to_dict()
    if not records:
        raise TraceError(
            f"category 'agentic': {shown} holds no usable request (read {summary.read}, quarantined "
            f"{summary.quarantined}: {dict(summary.by_reason)}); an empty trace file is an error, not a zero")
    sessions: OrderedDict[str, list] = OrderedDict()
    for rec in records:
        sessions.setdefault(rec.session_id, []).append(rec)

    def candidates():
        for session_id, recs in sessions.items():
            recs = sorted(recs, key=lambda r: (r.timestamp, r.input_ids.shape[0]))
            for rec in recs[-per_session:]:
                yield Trace(rec.request_id, "agentic", [int(i) for i in rec.input_ids.tolist()],
                            {"session_id": session_id, "turns_in_session": len(recs),
                             "logged_output_tokens": int(rec.output_ids.shape[0]), "source": rec.source})

    out = _take(candidates(), "agentic", max_prompts, max_tokens, max_new_tokens, max_positions,
                f"agent sessions from {shown} ({len(sessions)} sessions, {len(records)} requests)")
    out.ingest = ingest
    return out
