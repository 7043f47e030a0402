"""The agents: main sessions and their sub-agents as a state machine around the target's batched generation.
Each round every agent waiting for the model gets its next output; the output decides the next request
(a tool result, a sub-agent spawn, a compaction), built as token ids that extend the previous request."""

from __future__ import annotations

import hashlib
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data.trajectory.reader import TrajectoryRecord
from drafters.target.chat import encode, prompt_ids, render
from engines.hf.generation import BatchGenerator
from simulator.config import (
    BASE_EPOCH,
    COMPACT_PROMPT,
    GENERATOR,
    RUN_KINDS,
    SESSION_SPACING_S,
    SUB_TASKS,
    TASKS,
    TOOL_WEIGHTS,
    TURN_SENTINEL,
    SimConfig,
)
from simulator.workspace import Subject, Workspace


def cut_at_eos(row: list[int], limit: int, eos_set) -> tuple[list[int], bool]:
    """The first `limit` generated ids, up to and including the first EOS; whether an EOS ended them."""
    row = row[:limit]
    cut = next((k for k, t in enumerate(row) if t in eos_set), None)
    return (row if cut is None else row[: cut + 1]), cut is not None


class TargetGenerator:
    """The target's batched generation (engines.hf.generation, as regeneration generates), cut at each prompt's limit
    and end of turn, with the counts the summary reports."""

    def __init__(self, model, tokenizer, temperature: float, seed: int):
        self.batch = BatchGenerator(model, tokenizer, temperature, seed, top_p=1.0, top_k=0)
        self.eos_ids = self.batch.eos_ids
        self.eos_set = set(self.eos_ids)
        self.generated = 0
        self.prefill = 0

    @property
    def seconds(self) -> float:
        return self.batch.seconds

    def __call__(self, prompts: list[list[int]], limits: list[int], keys: list[str]) -> list[tuple[list[int], bool]]:
        """Generate for each prompt; returns (generated ids incl. EOS if produced, finished)."""
        results = []
        for row, limit in zip(self.batch.generate(prompts, max(limits), keys), limits):
            gen, finished = cut_at_eos(row, limit, self.eos_set)
            results.append((gen, finished))
            self.generated += len(gen)
        self.prefill += sum(len(p) for p in prompts)
        return results


@dataclass
class PendingRequest:
    ids: list[int]
    limit: int
    meta: dict[str, Any]
    parent_request_id: str | None
    new_tokens: int  # tokens of the new part (the whole prompt when it is rendered afresh)


@dataclass
class Agent:
    session_id: str
    kind: str  # "main" | "sub"
    rng: random.Random
    target: Subject
    turns: int  # assistant turns (normal requests) to run
    messages: list[dict[str, str]]  # the conversation as text (rendering only; ids are authoritative)
    head: list[dict[str, str]]  # [system, first user message]: what a compacted context restarts from
    clock: float  # simulated seconds since BASE_EPOCH
    spawn_turn: int | None = None
    n_subagents: int = 0
    parent: "Agent | None" = None
    done_turns: int = 0
    requests: int = 0
    compactions: int = 0
    context: list[int] = field(default_factory=list)  # ids of the last request + its output (+ EOS)
    pending: PendingRequest | None = None
    last_request_id: str | None = None
    after_summary: dict[str, Any] | None = None  # the tool message held back while compacting
    waiting_for: list["Agent"] = field(default_factory=list)
    final_text: str = ""
    finished: bool = False
    cursor: dict[str, int] = field(default_factory=dict)  # last line read per file (reads continue there)


def seeded_rng(*parts: object) -> random.Random:
    digest = hashlib.sha256("\x00".join(str(p) for p in ("agentic-sim-v1", *parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def session_id_for(split: str, seed: int, index: int) -> str:
    h = hashlib.sha256(f"agentic-session\x00{split}\x00{seed}\x00{index}".encode()).hexdigest()[:8]
    return f"agentic-{split}-s{seed}-{index:04d}-{h}"


class Simulator:
    def __init__(self, config: SimConfig, generate: TargetGenerator, tokenizer, workspace: Workspace, model_name: str):
        self.config = config
        self.generate = generate
        self.tok = tokenizer
        self.ws = workspace
        self.model_name = model_name
        self.eos_text = tokenizer.decode([generate.eos_ids[0]])
        self.close_ids = encode(tokenizer, self.eos_text)
        self.records: list[TrajectoryRecord] = []
        self.agents: list[Agent] = []
        self.rounds = 0

    # -- rendering ----------------------------------------------------------------------------------

    def _continuation(self, messages: list[dict[str, str]], new: list[dict[str, str]]) -> list[int]:
        """Ids the template puts after the last assistant turn's end-of-turn token: the separator, the new
        messages and the generation prompt (``messages`` ends with that assistant turn)."""
        with_sentinel = messages[:-1] + [{"role": "assistant", "content": TURN_SENTINEL}]
        prev = render(self.tok, with_sentinel)
        full = render(self.tok, with_sentinel + new, add_generation_prompt=True)
        if not full.startswith(prev):
            raise RuntimeError("the chat template is not prefix-stable; ids cannot be extended turn by turn")
        tail = prev[prev.rindex(TURN_SENTINEL) + len(TURN_SENTINEL):]
        if not tail.startswith(self.eos_text):
            raise RuntimeError(f"the template closes an assistant turn with {tail[:20]!r}, not {self.eos_text!r}")
        return encode(self.tok, tail[len(self.eos_text):] + full[len(prev):])

    def _tool_message(self, call: str, result: str) -> dict[str, str]:
        return {"role": self.config.tool_role, "content": f"[{call}]\n{result}"}

    # -- session construction -------------------------------------------------------------------

    def _new_main(self, index: int) -> Agent:
        cfg = self.config
        rng = seeded_rng(cfg.split, cfg.seed, index)
        target = self.ws.pick_target(rng)
        task = rng.choice(sorted(TASKS))
        user = TASKS[task].format(name=target.name, path=target.path)
        turns = rng.randint(*cfg.turns)
        spawn = rng.random() < cfg.subagent_share and turns >= 3
        head = [{"role": "system", "content": cfg.system_prompt}, {"role": "user", "content": user}]
        agent = Agent(session_id=session_id_for(cfg.split, cfg.seed, index), kind="main", rng=rng, target=target,
                       turns=turns, messages=list(head), head=head,
                       clock=index * SESSION_SPACING_S + rng.uniform(0, SESSION_SPACING_S / 2),
                       spawn_turn=rng.randint(1, turns - 2) if spawn else None,
                       n_subagents=rng.randint(*cfg.subagents) if spawn else 0)
        ids = prompt_ids(self.tok, head)
        agent.pending = PendingRequest(ids, cfg.max_new_tokens, {"kind": "task", "new_role": "user", "tool": None,
                                                            "task": task, "subject": f"{target.path}:{target.name}",
                                                            "files": []}, None, len(ids))
        return agent

    def _spawn(self, parent: Agent, spawn_request_id: str) -> list[Agent]:
        cfg, subs = self.config, []
        for j in range(parent.n_subagents):
            rng = seeded_rng(cfg.split, cfg.seed, parent.session_id, "sub", j)
            other = self.ws.pick_target(rng, folder=parent.target.folder, exclude=parent.target.path)
            text = rng.choice(SUB_TASKS).format(other=other.path, name=parent.target.name, path=parent.target.path,
                                                folder=parent.target.folder or ".", short=parent.target.short)
            user = {"role": "user", "content": f"[sub-agent {j + 1} of {parent.n_subagents}] You are a sub-agent "
                                               f"of the main agent, with the same tools. Delegated task: {text} "
                                               "Reply to the main agent with a short report when done."}
            sub = Agent(session_id=f"{parent.session_id}.sub{j + 1}", kind="sub", rng=rng, target=other,
                         turns=rng.randint(*cfg.sub_turns), messages=parent.messages + [user],
                         head=[parent.head[0], user], clock=parent.clock + 0.05 * (j + 1), parent=parent)
            part = self._continuation(parent.messages, [user])
            sub.pending = PendingRequest(parent.context + part, cfg.max_new_tokens,
                                   {"kind": "delegated_task", "new_role": "user", "tool": None,
                                    "subject": f"{other.path}:{other.name}", "files": []},
                                   spawn_request_id, len(part))
            subs.append(sub)
        return subs

    # -- tools ------------------------------------------------------------------------------------

    def _tool_call(self, agent: Agent) -> tuple[str, str, str, list[str]]:
        """(tool name, call text, result text, files read) for the agent's next scripted action."""
        rng, t, ws = agent.rng, agent.target, self.ws
        step = agent.done_turns  # 1 after the first assistant turn
        if step == 1:
            action = "read_file" if agent.kind == "sub" else rng.choice(["list_dir", "grep"])
        elif step == 2 and agent.kind == "main":
            action = "read_file"
        else:
            action = rng.choices(list(TOOL_WEIGHTS), weights=list(TOOL_WEIGHTS.values()))[0]
        if action == "read_file":
            last, n = agent.cursor.get(t.path), self.ws.docs[t.path].text.count("\n") + 1
            if last is None:  # the subject itself
                start, end = t.start, min(t.end, t.start + 60)
            elif last < n and rng.random() < 0.6:  # continue reading where the last read stopped
                start, end = last + 1, last + rng.randint(30, 60)
            else:  # elsewhere in the file
                start = rng.randint(1, max(1, n - 20))
                end = start + rng.randint(20, 60)
            agent.cursor[t.path] = min(end, n)
            call, result, files = ws.read_file(t.path, start, end)
        elif action == "read_other":
            other = ws.pick_target(rng, folder=t.folder, exclude=t.path)
            action = "read_file"
            call, result, files = ws.read_file(other.path, other.start, min(other.end, other.start + 40))
        elif action == "list_dir":
            call, result, files = ws.list_dir(t.folder)
        elif action == "grep":
            call, result, files = ws.grep(t.short, t.folder)
        else:
            call, result, files = ws.run(rng.choice(RUN_KINDS), t.path)
        return action, call, result, files

    # -- the state machine ----------------------------------------------------------------------------

    def _record(self, agent: Agent, pending: PendingRequest, output: list[int], finished: bool, batch_rows: int) -> str:
        cfg = self.config
        request_id = f"{agent.session_id}/r{agent.requests:03d}"
        meta = {
            "turn": agent.requests, "assistant_turn": agent.done_turns, "agent": agent.kind,
            **pending.meta, "compactions": agent.compactions, "new_part_tokens": pending.new_tokens,
            "finish_reason": "stop" if finished else "length", "max_new_tokens": pending.limit,
            "batch_rows": batch_rows, "model": self.model_name,
            "temperature": cfg.temperature, "dtype": cfg.dtype, "split": cfg.split, "seed": cfg.seed,
            "generator": GENERATOR, "simulated": True,
        }
        if agent.parent is not None:
            meta["parent_session_id"] = agent.parent.session_id
        self.records.append(TrajectoryRecord(
            session_id=agent.session_id, request_id=request_id,
            input_ids=np.asarray(pending.ids, dtype=np.int32), output_ids=np.asarray(output, dtype=np.int32),
            timestamp=round(BASE_EPOCH + agent.clock, 3), parent_request_id=pending.parent_request_id,
            metadata=meta))
        agent.requests += 1
        # Simulated server latency: prefill and decode at a production-like pace.
        agent.clock += 0.3 + len(pending.ids) / 20_000 + 0.02 * len(output)
        return request_id

    def _queue(self, agent: Agent, new: list[dict[str, str]], meta: dict[str, Any]) -> None:
        """Queue the next request: the context so far + the new messages, or a compaction first."""
        cfg = self.config
        part = self._continuation(agent.messages, new)
        ids = agent.context + part
        limit = cfg.max_new_tokens
        if len(ids) + limit > cfg.context_cap:
            # Ask for a summary first; the new messages wait for the compacted context.
            agent.after_summary = {"new": new, "meta": meta}
            ask = [{"role": "user", "content": COMPACT_PROMPT}]
            ask_part = self._continuation(agent.messages, ask)
            agent.pending = PendingRequest(agent.context + ask_part, cfg.summary_tokens,
                                     {"kind": "compaction_request", "new_role": "user", "tool": None, "files": []},
                                     agent.last_request_id, len(ask_part))
            agent.messages = agent.messages + ask
            return
        agent.messages = agent.messages + new
        agent.pending = PendingRequest(ids, limit, dict(meta), agent.last_request_id, len(part))

    def _after_output(self, agent: Agent, pending: PendingRequest, output: list[int], finished: bool,
                      request_id: str) -> list[Agent]:
        """Update the agent after a generation; returns newly spawned sub-agents."""
        agent.last_request_id = request_id
        text = self.tok.decode(output, skip_special_tokens=True).strip()
        agent.context = pending.ids + output + ([] if finished else self.close_ids)
        agent.messages = agent.messages + [{"role": "assistant", "content": text}]
        agent.pending = None
        if pending.meta["kind"] == "compaction_request":
            return self._compact(agent, text)
        agent.done_turns += 1
        agent.final_text = text
        if agent.done_turns >= agent.turns:
            agent.finished = True
            if agent.parent is not None:
                self._maybe_resume(agent.parent)
            return []
        if agent.kind == "main" and agent.spawn_turn is not None and agent.done_turns == agent.spawn_turn:
            subs = self._spawn(agent, request_id)
            agent.waiting_for = subs
            return subs
        tool, call, result, files = self._tool_call(agent)
        agent.clock += {"read_file": 0.05, "list_dir": 0.02, "grep": 0.2, "run": 1.0}.get(tool, 0.1) \
            + agent.rng.uniform(0, 0.5)
        self._queue(agent, [self._tool_message(call, result)],
                    {"kind": "tool_result", "new_role": self.config.tool_role, "tool": tool, "call": call,
                     "files": files})
        return []

    def _compact(self, agent: Agent, summary: str) -> list[Agent]:
        agent.compactions += 1
        held = agent.after_summary
        agent.after_summary = None
        summary_msg = {"role": "user", "content": "[compacted context] Summary of the earlier turns, written by "
                                                  f"you:\n{summary or '(empty summary)'}"}
        messages = agent.head + [summary_msg] + held["new"]
        agent.messages = messages
        agent.context = []
        meta = dict(held["meta"], kind="post_compaction", compacted_from=held["meta"]["kind"])
        ids = prompt_ids(self.tok, messages)
        agent.pending = PendingRequest(ids, self.config.max_new_tokens, meta, agent.last_request_id, len(ids))
        return []

    def _maybe_resume(self, parent: Agent) -> None:
        if not parent.waiting_for or not all(s.finished for s in parent.waiting_for):
            return
        subs, parent.waiting_for = parent.waiting_for, []
        parent.clock = max([parent.clock] + [s.clock for s in subs])
        reports = "\n\n".join(f"[sub-agent {k} report]\n{s.final_text or '(no report)'}" for k, s in enumerate(subs, 1))
        call = f"task(n={len(subs)})"
        meta = {"kind": "tool_result", "new_role": self.config.tool_role, "tool": "task", "call": call, "files": [],
                "subagent_sessions": [s.session_id for s in subs]}
        self._queue(parent, [self._tool_message(call, self.ws.trim(reports))], meta)

    # -- main loop ----------------------------------------------------------------------------------

    def run(self, progress: bool = True) -> list[TrajectoryRecord]:
        cfg = self.config
        self.agents = [self._new_main(i) for i in range(cfg.sessions)]
        started = time.perf_counter()
        while True:
            ready = [a for a in self.agents if a.pending is not None]
            if not ready:
                stuck = [a.session_id for a in self.agents if not a.finished]
                if stuck:
                    raise RuntimeError(f"internal error: sessions waiting with nothing to run: {stuck[:3]}")
                break
            self.rounds += 1
            ready.sort(key=lambda a: (len(a.pending.ids), a.session_id))
            spawned: list[Agent] = []
            for start in range(0, len(ready), cfg.batch_size):
                batch = ready[start:start + cfg.batch_size]
                pend = [a.pending for a in batch]
                keys = [f"{a.session_id}/r{a.requests:03d}" for a in batch]
                outs = self.generate([p.ids for p in pend], [p.limit for p in pend], keys)
                for agent, p, (gen, finished) in zip(batch, pend, outs):
                    rid = self._record(agent, p, gen, finished, len(batch))
                    spawned += self._after_output(agent, p, gen, finished, rid)
            self.agents += spawned
            if progress:
                active = sum(not a.finished for a in self.agents)
                print(f"[simulate] round {self.rounds}: {len(ready)} requests, {len(self.records)} logged, "
                      f"{active} sessions active, {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
        self.records.sort(key=lambda r: (r.timestamp, r.request_id))
        return self.records
