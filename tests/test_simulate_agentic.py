"""Agentic trace simulator with the real SmolLM2-135M-Instruct target (tiny budgets, no mocks).

One fp32 run (2 sessions x 3 turns x 8 new tokens, every session spawns a sub-agent, a context cap small
enough to force compactions) is checked for format, exact greedy outputs, prefix sharing, sub-agent
forks and dedup; tiny 1-session runs check determinism and the train / held-out separation.
"""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
import torch

from drafters.target.chat import encode, render
from data.trajectory.prefix_tree import build_prefix_tree
from data.sources.builtin import load_code, split_documents
from data.trajectory.reader import load_trajectories
from scripts.cli import main
from simulator.simulate import SimConfig, Workspace, log_path, parse_range, simulate

VOCAB = 49_152
SYSTEM = "You are a coding agent. Tools: read_file, list_dir, grep, run, task. One tool call per turn."


THREADS = 1  # the CPU is shared: one torch thread avoids stalls when the other core is busy


def tiny(**kw) -> SimConfig:
    base = dict(sessions=2, split="train", seed=0, turns=3, subagent_share=1.0, subagents=1, sub_turns=2,
                max_new_tokens=6, summary_tokens=6, tool_tokens=32, context_cap=200, batch_size=8,
                dtype="fp32", system_prompt=SYSTEM)
    base.update(kw)
    return SimConfig(**base)


@pytest.fixture(scope="module")
def target(testbed_target):
    return testbed_target


@pytest.fixture(scope="module")
def tokenizer(target):
    from drafters.target.chat import load_tokenizer

    return load_tokenizer(target)


def _load(target, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).eval()


@pytest.fixture(scope="module")
def model(target):
    """fp32: batched generation equals unbatched generation token for token (bf16 may differ at near-ties)."""
    return _load(target, torch.float32)


@pytest.fixture(scope="module")
def run(target, model, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    return simulate(tiny(), out, target, model=model, tokenizer=tokenizer, num_threads=THREADS, progress=False)


def _lcp(a, b) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _by_session(records):
    sessions: dict[str, list] = {}
    for r in records:
        sessions.setdefault(r.session_id, []).append(r)
    for recs in sessions.values():
        recs.sort(key=lambda r: r.metadata["turn"])
    return sessions


# -- the log -------------------------------------------------------------------------------------------


def test_log_loads_with_zero_quarantined_and_reconciles(run, tmp_path):
    assert run.path.name.endswith(".jsonl.gz") and run.path == log_path(run.path.parent, tiny())
    records, summary = load_trajectories(run.path, VOCAB, quarantine_path=tmp_path / "q.jsonl")
    assert summary.quarantined == 0 and summary.reconciles()
    assert summary.read == summary.accepted == len(run.records) == run.summary["requests"]
    assert len({r.request_id for r in records}) == len(records)
    on_disk = {r.request_id: r for r in records}
    for rec in run.records:  # the loaded ids are the generated ids, untouched
        assert np.array_equal(on_disk[rec.request_id].input_ids, rec.input_ids)
        assert np.array_equal(on_disk[rec.request_id].output_ids, rec.output_ids)
    for r in records:
        m = r.metadata
        assert {"turn", "agent", "new_role", "tool", "kind", "finish_reason", "model", "split"} <= set(m)
        assert m["split"] == "train" and m["generator"] == "scripts.simulate_agentic"
        assert 1 <= len(r.output_ids) <= m["max_new_tokens"]
        assert (m["finish_reason"] == "stop") == (int(r.output_ids[-1]) == 2)  # <|im_end|>
        assert m["new_role"] in ("user", "tool")
        if m["kind"] == "tool_result":
            assert m["new_role"] == "tool" and m["tool"] in ("read_file", "list_dir", "grep", "run", "task")
    # Timestamps: simulated, increasing within a session.
    for recs in _by_session(records).values():
        assert all(a.timestamp < b.timestamp for a, b in zip(recs, recs[1:]))
    # The summary written next to the log agrees with the log.
    written = json.loads(run.summary_path.read_text())
    assert run.summary_path.parent == run.path.parent
    assert written["requests"] == len(records)
    assert written["logged_tokens"] == sum(r.num_tokens for r in records)
    tree = build_prefix_tree(records).stats()
    assert written["unique_tokens"] == tree.unique_tokens < tree.logged_tokens
    assert written["dedup_ratio"] > 1.0 and written["prefix_reuse"] > 0.5
    assert written["sessions"] == 4 and written["sub_sessions"] == 2 and written["compactions"] >= 1


def test_outputs_are_the_targets_greedy_generation(run, model):
    """Re-generate two requests unbatched with HF generate: the logged output is exactly that."""
    recs = [r for r in run.records if r.metadata["batch_rows"] > 1]  # generated inside a padded batch
    picks = [max(recs, key=lambda r: len(r.input_ids)),
             next(r for r in recs if r.metadata["agent"] == "sub")]
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        for rec in picks:
            ids = torch.tensor([rec.input_ids.tolist()])
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=rec.metadata["max_new_tokens"], eos_token_id=[2], pad_token_id=2)
            gen = out[0, ids.shape[1]:].tolist()
            gen = gen[: gen.index(2) + 1] if 2 in gen else gen
            assert gen == rec.output_ids.tolist(), rec.request_id
    finally:
        torch.set_num_threads(previous)


def test_consecutive_requests_extend_the_previous_one_except_after_compaction(run, tokenizer):
    system_ids = encode(tokenizer, render(tokenizer, [{"role": "system", "content": SYSTEM}]))
    compacted = 0
    for recs in _by_session(run.records).values():
        first = recs[0]
        for prev, nxt in zip(recs, recs[1:]):
            assert nxt.parent_request_id == prev.request_id
            context = np.concatenate([prev.input_ids, prev.output_ids])
            if nxt.metadata["kind"] == "post_compaction":
                compacted += 1
                assert prev.metadata["kind"] == "compaction_request"
                # A new branch: it restarts from the system prompt and the session's first message ...
                assert _lcp(nxt.input_ids, context) < len(context)
                assert nxt.input_ids[: len(system_ids)].tolist() == system_ids
                if nxt.metadata["agent"] == "main":
                    assert _lcp(nxt.input_ids, first.input_ids) >= len(first.input_ids) - 3
                # ... and carries the summary the target wrote.
                summary = tokenizer.decode(prev.output_ids, skip_special_tokens=True).strip()
                assert summary in tokenizer.decode(nxt.input_ids)
                assert nxt.metadata["compactions"] == prev.metadata["compactions"] + 1
            else:
                assert np.array_equal(nxt.input_ids[: len(context)], context), nxt.request_id
                assert len(nxt.input_ids) > len(context)
                # A turn cut by the token limit is closed with <|im_end|>, as a server does.
                if prev.metadata["finish_reason"] == "length":
                    assert int(nxt.input_ids[len(context)]) == 2
    assert compacted >= 1


def test_subagents_fork_from_the_parent_context(run):
    by_id = {r.request_id: r for r in run.records}
    sessions = _by_session(run.records)
    subs = [recs for sid, recs in sessions.items() if recs[0].metadata["agent"] == "sub"]
    assert len(subs) == 2
    for recs in subs:
        first = recs[0]
        assert first.metadata["kind"] == "delegated_task" and first.parent_request_id is not None
        spawner = by_id[first.parent_request_id]
        assert spawner.session_id == first.metadata["parent_session_id"] != first.session_id
        assert spawner.metadata["agent"] == "main"
        context = np.concatenate([spawner.input_ids, spawner.output_ids])
        assert np.array_equal(first.input_ids[: len(context)], context)
        assert first.timestamp > spawner.timestamp
        # The parent resumes with the sub-agent's report as a `task` tool result, after it finished.
        parent = sessions[spawner.session_id]
        resumed = parent[parent.index(spawner) + 1]
        if resumed.metadata["kind"] == "compaction_request":
            resumed = parent[parent.index(spawner) + 2]
        assert resumed.metadata["tool"] == "task" and first.session_id in resumed.metadata["subagent_sessions"]
        assert resumed.timestamp > recs[-1].timestamp


def test_tools_read_only_files_of_the_split(run):
    train, heldout = split_documents(load_code())
    train_ids, heldout_ids = {d.id for d in train}, {d.id for d in heldout}
    assert run.files_read and set(run.files_read) <= train_ids and not set(run.files_read) & heldout_ids
    for r in run.records:
        assert set(r.metadata["files"]) <= set(run.files_read)


# -- determinism and split separation ------------------------------------------------------------------


def _content(path) -> bytes:
    with gzip.open(path, "rb") as f:  # the gzip header holds a temp name and mtime: compare the content
        return f.read()


def test_same_seed_same_log_and_train_heldout_disjoint(target, tokenizer, tmp_path, capsys):
    # bf16 (the default dtype), 1 session x 3 turns x 4 new tokens.
    bf16 = _load(target, torch.bfloat16)
    cfg = dict(sessions=1, turns=3, subagent_share=0.0, max_new_tokens=4, tool_tokens=32, context_cap=400,
               dtype="bf16")
    a, b = (simulate(tiny(**cfg), tmp_path / d, target, model=bf16, tokenizer=tokenizer, num_threads=THREADS,
                     progress=False) for d in "ab")
    assert _content(a.path) == _content(b.path)
    assert [r.request_id for r in a.records] == [r.request_id for r in b.records]
    # Held-out run through the CLI: disjoint session ids, files and seed space.
    assert main(["simulate", "--out", str(tmp_path / "h"), "--sessions", "1", "--split", "heldout", "--turns", "3",
                 "--subagent-share", "0", "--max-new-tokens", "4", "--tool-tokens", "32", "--threads", "1",
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "sessions: 1" in printed and "prefix reuse" in printed and "tok/s" in printed
    hpath = tmp_path / "h" / "agentic-heldout-seed0.jsonl.gz"
    held, summary = load_trajectories(hpath, VOCAB)
    assert summary.quarantined == 0 and len(held) >= 2
    hsum = json.loads((tmp_path / "h" / "agentic-heldout-seed0.summary.json").read_text())
    assert hsum["config"]["split"] == "heldout" and hsum["requests"] == len(held)
    train_docs, heldout_docs = split_documents(load_code())
    held_files = {f for r in held for f in r.metadata["files"]}
    train_files = set(a.files_read)
    assert held_files and held_files <= {d.id for d in heldout_docs}
    assert train_files <= {d.id for d in train_docs} and not held_files & train_files
    assert not {r.session_id for r in held} & {r.session_id for r in a.records}
    assert not {r.request_id for r in held} & {r.request_id for r in a.records}
    assert all("-heldout-" in r.session_id for r in held) and all("-train-" in r.session_id for r in a.records)
    # Different seed space: the held-out session with the same index and seed works on another task.
    assert held[0].metadata["subject"] != a.records[0].metadata["subject"]


# -- tools and config without the model -------------------------------------------------------------


def test_tools_return_real_content(tokenizer):
    train, _ = split_documents(load_code())
    ws = Workspace(train, tokenizer, tool_tokens=64)
    try:
        path = "json/decoder.py" if "code:json/decoder.py" in {d.id for d in train} else train[0].id[5:]
        call, text, files = ws.run("py_compile", path)
        assert text == f"$ python -m py_compile {path}\n[exit code 0, no output]" and files == [f"code:{path}"]
        _, text, _ = ws.run("tabnanny", path)
        assert "Clean bill of health" in text
        folder = os.path.dirname(path)
        _, text, files = ws.list_dir(folder)
        first = sorted(n for n in os.listdir(ws.root / folder) if n != "__pycache__")[0]
        assert files == [] and text.split("\n")[0].rstrip("/") == first
        _, text, _ = ws.read_file(path, 1, 400)
        assert len(encode(tokenizer, text)) <= 64 and "more lines truncated" in text
        assert text.startswith("     1\t")
    finally:
        ws.close()


def test_config_validation():
    assert parse_range("6-8") == (6, 8) and parse_range("3") == (3, 3) and parse_range(2) == (2, 2)
    with pytest.raises(ValueError):
        parse_range("8-6")
    with pytest.raises(ValueError):
        SimConfig(split="test")
    defaults = SimConfig()
    assert defaults.turns == (6, 8) and defaults.subagent_share == 0.44 and defaults.subagents == (1, 2)
    assert 48 <= defaults.max_new_tokens <= 96 and 1024 <= defaults.context_cap <= 1536
