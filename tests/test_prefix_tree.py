"""Prefix dedup of agentic traffic: radix tree structure, loss mask, paths, windows, dataset."""

from __future__ import annotations


import numpy as np
import pytest

from data.trajectory.prefix_tree import PrefixTree, paths_to_dataset
from data.trajectory.reader import TrajectoryReader, write_trajectories

VOCAB = 50_000


def toks(rng, n):
    return rng.integers(0, VOCAB, n).tolist()


def linear_session(rng, turns=6, system=30, new=5, out=7, session="s"):
    """[(input_ids, output_ids, request_id)]: each prompt = all previous turns + a short new part."""
    reqs, hist = [], toks(rng, system)
    for t in range(turns):
        inp = hist + toks(rng, new)
        o = toks(rng, out)
        reqs.append((inp, o, f"{session}-{t}"))
        hist = inp + o
    return reqs


def build(reqs, session="s"):
    tree = PrefixTree()
    for inp, out, rid in reqs:
        tree.add(inp, out, session_id=rid.split("-")[0] if "-" in rid else session, request_id=rid)
    return tree


def full_paths(tree, **kw):
    return list(tree.iter_paths(None, loss_once=False, **kw))


def test_linear_multi_turn_session_is_one_leaf():
    rng = np.random.default_rng(0)
    reqs = linear_session(rng, turns=8)
    tree = build(reqs)
    st = tree.stats()
    last = reqs[-1][0] + reqs[-1][1]
    assert st.leaves == 1 and st.edges == 1  # compacted: the 8 turns are one edge
    assert st.unique_tokens == len(last)
    assert st.logged_tokens == sum(len(i) + len(o) for i, o, _ in reqs)
    assert st.dedup_ratio == pytest.approx(st.logged_tokens / len(last))
    (path,) = full_paths(tree)
    assert path.input_ids.tolist() == last
    expected_mask = np.zeros(len(last), np.int8)  # every turn's output, even once it is inside a prompt
    for inp, out, _ in reqs:
        expected_mask[len(inp) : len(inp) + len(out)] = 1
    assert path.loss_mask.tolist() == expected_mask.tolist()
    assert path.request_ids == [rid for _, _, rid in reqs]
    assert st.unique_generated_tokens == int(expected_mask.sum())


def test_subagent_fork_shares_the_parent_prefix():
    rng = np.random.default_rng(1)
    parent = linear_session(rng, turns=5, session="p")
    spawn_inp, spawn_out, spawn_id = parent[2]  # turn 2 calls a tool that spawns the sub-agent
    sub_hist = spawn_inp + spawn_out + toks(rng, 6)  # sub-agent: parent context + its task
    sub = []
    for t in range(3):
        o = toks(rng, 4)
        sub.append((sub_hist, o, f"c-{t}"))
        sub_hist = sub_hist + o + toks(rng, 3)
    tree = build(parent + sub)
    st = tree.stats()
    shared = len(spawn_inp) + len(spawn_out)
    parent_last = parent[-1][0] + parent[-1][1]
    sub_last = sub[-1][0] + sub[-1][1]
    assert st.leaves == 2
    assert st.unique_tokens == len(parent_last) + len(sub_last) - shared
    edges = list(tree.iter_edges())
    assert [e.parent_id for e in edges] == [-1, 0, 0]
    assert edges[0].start == 0 and len(edges[0].tokens) == shared
    assert edges[1].start == edges[2].start == shared  # children start where the parent edge ends
    p_path, s_path = list(tree.iter_paths())  # loss_once: the shared prefix is trained once
    assert p_path.input_ids.tolist() == parent_last and s_path.input_ids.tolist() == sub_last
    assert s_path.loss_start == shared and not s_path.loss_mask[:shared].any()
    assert s_path.loss_mask[shared:].any() and p_path.loss_mask[:shared].any()
    assert int(p_path.loss_mask.sum() + s_path.loss_mask.sum()) == st.unique_generated_tokens
    assert s_path.session_ids == ["p", "c"] and "c-0" in s_path.request_ids and "p-4" not in s_path.request_ids


def test_edit_or_compaction_mid_prompt_makes_a_branch():
    rng = np.random.default_rng(2)
    reqs = linear_session(rng, turns=4, system=40)
    hist = reqs[-1][0] + reqs[-1][1]
    # Context compaction: keep the system prompt, replace the history by a summary, continue.
    compacted = hist[:40] + toks(rng, 12)
    reqs += [(compacted, toks(rng, 5), "s-4")]
    reqs += [(reqs[-1][0] + reqs[-1][1] + toks(rng, 4), toks(rng, 6), "s-5")]
    tree = build(reqs)
    st = tree.stats()
    assert st.leaves == 2
    paths = full_paths(tree)
    assert [len(p.input_ids) for p in paths] == [len(hist), len(reqs[-1][0]) + len(reqs[-1][1])]
    assert paths[0].input_ids[:40].tolist() == paths[1].input_ids[:40].tolist()
    assert st.unique_tokens == len(hist) + len(paths[1].input_ids) - 40
    edges = list(tree.iter_edges())
    assert len(edges) == 3 and len(edges[0].tokens) == 40 and [e.is_leaf for e in edges] == [False, True, True]


def test_identical_requests_add_no_tokens():
    rng = np.random.default_rng(3)
    inp, out = toks(rng, 50), toks(rng, 10)
    tree = PrefixTree()
    tree.add(inp, out, session_id="a", request_id="a-0")
    before = tree.stats()
    tree.add(inp, out, session_id="b", request_id="b-0")  # e.g. a retry or another session, same content
    tree.add(inp, out, session_id="b", request_id="b-1")
    after = tree.stats()
    assert after.unique_tokens == before.unique_tokens == 60 and after.leaves == 1 and after.edges == 1
    assert after.requests == 3 and after.logged_tokens == 180 and after.dedup_ratio == pytest.approx(3.0)
    (path,) = tree.iter_paths()
    assert path.request_ids == ["a-0", "b-0", "b-1"] and path.session_ids == ["a", "b"]
    # A request that is a strict prefix of an existing one ends mid-edge: no new token, no new leaf.
    tree.add(inp[:20], inp[20:30], request_id="pre")
    assert tree.stats().unique_tokens == 60 and tree.stats().leaves == 1
    assert "pre" in next(tree.iter_paths()).request_ids


def test_output_reappearing_in_a_prompt_keeps_its_loss_and_order_does_not_matter():
    rng = np.random.default_rng(4)
    p1, o1 = toks(rng, 20), toks(rng, 8)
    p2 = p1 + o1 + toks(rng, 5)  # turn 2's prompt contains turn 1's output as prompt tokens
    o2 = toks(rng, 6)
    for order in ([(p1, o1, "r1"), (p2, o2, "r2")], [(p2, o2, "r2"), (p1, o1, "r1")]):
        tree = build(order)
        (path,) = full_paths(tree)
        mask = path.loss_mask
        assert mask[20:28].tolist() == [1] * 8  # o1 positions: generated by the target in r1
        assert mask[28:33].tolist() == [0] * 5 and mask[:20].tolist() == [0] * 20
        assert mask[33:].tolist() == [1] * 6
    # The mask is per position, not per token value: the same tokens as prompt on another branch stay 0.
    tree = build([(p1, o1, "r1"), (toks(rng, 3) + o1, toks(rng, 2), "x")])
    other = [p for p in full_paths(tree) if p.request_ids == ["x"]][0]
    assert other.loss_mask[3:11].tolist() == [0] * 8


def random_traffic(seed, sessions=6):
    """Sessions with shared system prompts, forks (sub-agents), compactions and retries."""
    rng = np.random.default_rng(seed)
    systems = [toks(rng, 25) for _ in range(2)]
    reqs = []
    for s in range(sessions):
        hist = list(systems[s % 2])
        for t in range(int(rng.integers(2, 9))):
            r = rng.random()
            if r < 0.15 and len(hist) > 30:  # compaction / edit: diverge somewhere mid-prompt
                hist = hist[: int(rng.integers(1, len(hist)))] + toks(rng, 7)
            inp = hist + toks(rng, int(rng.integers(0, 6)))
            out = toks(rng, int(rng.integers(1, 9)))
            reqs.append((inp, out, f"s{s}-{t}"))
            if r > 0.9:
                reqs.append((inp, out, f"s{s}-{t}-retry"))
            if 0.8 < r <= 0.9:  # sub-agent forks from here with 2 turns of its own
                sh = inp + out + toks(rng, 4)
                for u in range(2):
                    so = toks(rng, 3)
                    reqs.append((sh, so, f"s{s}sub{t}-{u}"))
                    sh = sh + so + toks(rng, 2)
            hist = inp + out
    return reqs


@pytest.mark.parametrize("seed", range(5))
def test_every_request_is_reconstructed_exactly_from_the_paths(seed):
    reqs = random_traffic(seed)
    tree = build(reqs)
    paths = full_paths(tree)
    by_req = {rid: p for p in paths for rid in p.request_ids}
    assert set(by_req) == {rid for _, _, rid in reqs}  # every request is covered by some path
    for inp, out, rid in reqs:
        seq = inp + out
        p = by_req[rid]
        assert p.input_ids[: len(seq)].tolist() == seq  # the request is exactly a prefix of its path
        assert p.loss_mask[len(inp) : len(seq)].all()  # its output positions carry loss
        assert tree.contains_prefix(seq)
    assert not tree.contains_prefix(reqs[0][0] + [VOCAB + 1])
    st = tree.stats()
    edges = list(tree.iter_edges())
    assert st.unique_tokens == sum(len(e.tokens) for e in edges)
    assert st.leaves == len(paths) == sum(e.is_leaf for e in edges)
    # Rebuilding each path from the edge list (parent chain) gives the same sequences: the KV plan.
    seq_of = {}
    for e in edges:
        prefix = seq_of[e.parent_id] if e.parent_id >= 0 else []
        assert e.start == len(prefix)
        seq_of[e.edge_id] = prefix + e.tokens.tolist()
    assert sorted(seq_of[e.edge_id] for e in edges if e.is_leaf) == sorted(p.input_ids.tolist() for p in paths)
    # loss_once: every unique generated position is trained exactly once across paths.
    once = list(tree.iter_paths())
    assert sum(int(p.loss_mask.sum()) for p in once) == st.unique_generated_tokens
    # Insertion order does not change the tree's content.
    st2 = build(list(reversed(reqs))).stats()
    assert (st2.unique_tokens, st2.leaves, st2.unique_generated_tokens) == (st.unique_tokens, st.leaves, st.unique_generated_tokens)


@pytest.mark.parametrize("max_len,overlap", [(16, 0), (16, 5), (40, 10)])
def test_windows_cover_every_loss_token_once(max_len, overlap):
    reqs = random_traffic(11)
    tree = build(reqs)
    st = tree.stats()
    whole = {p.leaf_id: p for p in tree.iter_paths()}
    trained = 0
    for w in tree.iter_paths(max_len, overlap=overlap):
        full = whole[w.leaf_id]
        assert len(w.input_ids) <= max_len and w.loss_mask.any()
        assert w.input_ids.tolist() == full.input_ids[w.window_start : w.window_start + len(w.input_ids)].tolist()
        assert not w.loss_mask[: max(0, w.loss_start - w.window_start)].any()
        if w.path_len > max_len:
            assert len(w.input_ids) == max_len
        trained += int(w.loss_mask.sum())
    assert trained == st.unique_generated_tokens
    with pytest.raises(ValueError):
        next(tree.iter_paths(8, overlap=8))


def test_dataset_columns_and_provenance():
    reqs = random_traffic(7)
    tree = build(reqs)
    ds = tree.to_dataset(max_seq_len=32)
    assert set(ds.column_names) == {"input_ids", "loss_mask", "category", "provenance"}
    assert len(ds) > 0 and set(ds["category"]) == {"agentic"}
    paths = list(tree.iter_paths(32))
    assert len(ds) == len(paths)
    row = ds[0]
    assert row["input_ids"] == paths[0].input_ids.tolist() and row["loss_mask"] == paths[0].loss_mask.tolist()
    assert row["provenance"]["request_ids"] == paths[0].request_ids and row["provenance"]["session_ids"]
    assert sum(sum(m) for m in ds["loss_mask"]) == tree.stats().unique_generated_tokens
    assert str(ds.features["input_ids"].feature.dtype) == "int32"
    empty = paths_to_dataset([])
    assert len(empty) == 0 and "provenance" in empty.column_names


def test_long_session_collapses_to_one_edge():
    """Production shape: 43 turns, prompts growing to ~100K tokens (~3.9M logged tokens).

    Build speed is measured by bench/bench_prefix_dedup.py, not asserted here."""
    rng = np.random.default_rng(5)
    hist = rng.integers(0, VOCAB, 80_000, dtype=np.int32)
    reqs = []
    for t in range(43):
        inp = np.concatenate([hist, rng.integers(0, VOCAB, 100, dtype=np.int32)])
        out = rng.integers(0, VOCAB, 400, dtype=np.int32)
        reqs.append((inp, out))
        hist = np.concatenate([inp, out])
    tree = PrefixTree()
    for i, (inp, out) in enumerate(reqs):
        tree.add(inp, out, session_id="long", request_id=str(i))
    st = tree.stats()
    assert st.unique_tokens == len(hist) and st.leaves == 1 and st.edges == 1
    assert st.logged_tokens == sum(len(i) + len(o) for i, o in reqs) and st.dedup_ratio > 35


def test_streaming_build_from_trajectory_files(tmp_path):
    reqs = random_traffic(3)
    rows = [
        {"session_id": rid.split("-")[0], "request_id": rid, "input_ids": i, "output_ids": o, "timestamp": float(k)}
        for k, (i, o, rid) in enumerate(reqs)
    ]
    write_trajectories(rows[: len(rows) // 2], tmp_path / "a.parquet")
    write_trajectories(rows[len(rows) // 2 :], tmp_path / "b.jsonl.gz")
    reader = TrajectoryReader(tmp_path, VOCAB)
    tree = PrefixTree.from_records(reader)
    reader.summary.check()
    ref = build(reqs).stats()
    st = tree.stats()
    assert st.requests == len(reqs) == reader.summary.accepted
    assert (st.unique_tokens, st.leaves, st.logged_tokens) == (ref.unique_tokens, ref.leaves, ref.logged_tokens)
