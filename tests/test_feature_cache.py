"""Offline feature cache: round trips, crash + resume, prefix-tree capture, dataset checks, sizes.

Real tiny Llama target (fp32, random weights, 8 layers, hidden 64), no mocks.
"""

import json
import pickle

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from data.feature_cache import (
    CacheMismatchError,
    EarlierFeatures,
    FeatureCacheReader,
    TreeCaptureStats,
    feature_bytes_per_token,
    feature_cache_kwargs,
    iter_tree_features,
    quantize_fp8,
    row_prefix_tree,
    write_feature_cache,
    write_row_tree_feature_cache,
    write_tree_feature_cache,
)
from data.trajectory.prefix_tree import PrefixTree
from drafters.target.capture import HFCapture
from drafters.target.testbed import tiny_llama_target

LAYERS = [1, 3, 5, 7]  # 7 = last layer (normed output), exercises that path too
FP32_TOL = dict(atol=2e-5, rtol=2e-5)  # KV-continued vs one full forward in fp32: same math, other op order


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: with 2 intra-op threads on a shared 2-core box, spinning threads cost 30x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def capture(one_thread):
    cap = HFCapture(tiny_llama_target(), LAYERS)
    yield cap
    cap.remove()


def make_rows(n=14, seed=0, lo=3, hi=40, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(k)).tolist() for k in rng.integers(lo, hi, n)]


def make_dataset(rows):
    return datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                                       "category": ["chat"] * len(rows)})


@pytest.fixture(scope="module")
def rows():
    rows = make_rows()
    rows[5] = []  # an empty row is stored with length 0, not dropped
    return rows


@pytest.fixture(scope="module")
def direct(capture, rows):
    """Unpadded, one row at a time, fp32: the reference features."""
    out = []
    for r in rows:
        if not r:
            out.append((torch.zeros(0, len(LAYERS) * 64), torch.zeros(0, 64)))
            continue
        c = capture.capture(torch.tensor([r]))
        out.append((c.selected[0], c.final_hidden[0]))
    return out


def test_bf16_round_trip_is_exact_to_the_stored_dtype(capture, rows, direct, tmp_path):
    ds = make_dataset(rows)
    res = write_feature_cache(ds, capture, tmp_path / "c", dtype="bf16", shard_tokens=64, batch_size=1, progress=False)
    assert res.complete and res.shards_total >= 3 and res.padded_tokens == 0
    assert res.tokens_captured == sum(map(len, rows))
    reader = FeatureCacheReader(tmp_path / "c", ds, dtype=torch.float32)
    assert len(reader) == len(rows) and reader.num_tokens == sum(map(len, rows))
    seen = set()
    for i, (sel, fin) in enumerate(direct):
        got_sel, got_fin = reader.get(i)
        assert got_sel.shape == (len(rows[i]), len(LAYERS) * 64) and got_fin.shape == (len(rows[i]), 64)
        assert torch.equal(got_sel, sel.to(torch.bfloat16).float())
        assert torch.equal(got_fin, final := fin.to(torch.bfloat16).float()), i
        assert torch.equal(reader.get_ids(i), torch.tensor(rows[i], dtype=torch.int32))
        assert reader.get(i, torch.bfloat16)[1].dtype == torch.bfloat16
        if len(rows[i]) > 4:  # partial reads of a window
            assert torch.equal(reader.get(i, start=2, end=4)[1], final[2:4])
        shard, off, n = reader.locate(i)
        assert n == len(rows[i])
        seen.update((shard, off + t) for t in range(n))
    assert len(seen) == reader.num_tokens  # no two rows share a stored token
    # Pickles without its open handles (DataLoader workers) and reads the same afterwards.
    clone = pickle.loads(pickle.dumps(reader))
    assert torch.equal(clone.get(3)[0], reader.get(3)[0])

    # Batched capture (right padding + mask, length-sorted batches) gives the same rows up to one bf16
    # rounding step (padding changes fp32 op order by ~1e-6, which can flip a bf16 rounding).
    res_b = write_feature_cache(ds, capture, tmp_path / "b", dtype="bf16", shard_tokens=64, batch_size=4, progress=False)
    assert res_b.padded_tokens > 0
    batched = FeatureCacheReader(tmp_path / "b", ds, dtype=torch.float32)
    for i, (sel, fin) in enumerate(direct):
        torch.testing.assert_close(batched.get(i)[0], sel, atol=1e-5, rtol=2**-8)
        torch.testing.assert_close(batched.get(i)[1], fin, atol=1e-5, rtol=2**-8)


def test_fp8_round_trip_within_e4m3_bound(capture, rows, direct, tmp_path):
    """Per element |x - x_hat| <= 2**-4 |x| + 2**-10 * scale, scale = amax/448 of that token's layer.

    e4m3 keeps 3 mantissa bits: round-to-nearest costs at most half an ulp = 2**-4 relative for normal
    values; below the smallest normal (2**-6 in scaled units) the spacing is 2**-9, half of it 2**-10.
    """
    ds = make_dataset(rows)
    write_feature_cache(ds, capture, tmp_path / "c", dtype="fp8", shard_tokens=64, batch_size=1, progress=False)
    reader = FeatureCacheReader(tmp_path / "c", ds, dtype=torch.float32)
    worst = 0.0
    for i, (sel, fin) in enumerate(direct):
        got_sel, got_fin = reader.get(i)
        for x, got, groups in ((sel, got_sel, len(LAYERS)), (fin, got_fin, 1)):
            assert got.shape == x.shape
            if not len(x):
                continue
            xs = x.reshape(len(x), groups, -1)
            scale = xs.abs().amax(-1, keepdim=True) / 448
            err = (got.reshape(xs.shape) - xs).abs()
            bound = 2**-4 * xs.abs() + 2**-10 * scale
            assert (err <= bound * (1 + 1e-5) + 1e-12).all(), i
            worst = max(worst, float((err / bound.clamp_min(1e-30)).max()))
            assert not torch.equal(got, x)  # really quantised
    assert worst > 0.5  # the bound is tight, not vacuous
    # Scales are stored per token and layer: a layer 100x smaller than the others keeps its precision.
    x = torch.cat([torch.randn(8, 64) * 100, torch.randn(8, 64) * 0.01], -1)
    q, s = quantize_fp8(x, 2)
    assert s.shape == (8, 2) and s.dtype == torch.float32 and q.dtype == torch.float8_e4m3fn


def test_interrupted_capture_resumes_to_the_same_cache(capture, rows, tmp_path):
    ds = make_dataset(rows)
    kw = dict(dtype="fp8", shard_tokens=48, batch_size=3, progress=False)
    full = write_feature_cache(ds, capture, tmp_path / "full", **kw)
    assert full.complete and full.shards_total >= 5

    part = write_feature_cache(ds, capture, tmp_path / "part", stop_after_shards=2, **kw)
    assert not part.complete and part.shards_done == 2 and part.shards_written == 2
    with pytest.raises(CacheMismatchError, match="incomplete"):
        FeatureCacheReader(tmp_path / "part")
    # What a crash can leave behind: a temp file mid-write. A shard file that is not this cache's (here
    # garbage) does not count as done and is captured again.
    (tmp_path / "part" / ".shard-00002.safetensors.999.tmp").write_bytes(b"partial")
    (tmp_path / "part" / "shard-00003.safetensors").write_bytes(b"garbage")
    part = write_feature_cache(ds, capture, tmp_path / "part", stop_after_shards=1, **kw)
    assert part.shards_done == 3 and not part.complete
    rest = write_feature_cache(ds, capture, tmp_path / "part", **kw)
    assert rest.complete and rest.shards_written == full.shards_total - 3
    again = write_feature_cache(ds, capture, tmp_path / "part", **kw)  # complete: nothing to do
    assert again.shards_written == 0 and again.tokens_captured == 0

    # Two ranks fill one folder with no communication, each its own block of the plan; whichever
    # finishes last marks it complete.
    late = write_feature_cache(ds, capture, tmp_path / "ranks", rank=1, world_size=2, **kw)
    assert not late.complete and 0 < late.tokens_captured < full.tokens_captured
    first = write_feature_cache(ds, capture, tmp_path / "ranks", rank=0, world_size=2, **kw)
    assert first.complete and first.tokens_captured + late.tokens_captured == full.tokens_captured

    idx_full = json.loads((tmp_path / "full" / "index.json").read_text())
    shard_files = lambda folder: sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))  # noqa: E731
    for other in ("part", "ranks"):
        assert json.loads((tmp_path / other / "index.json").read_text()) == idx_full
        assert shard_files(tmp_path / other) == shard_files(tmp_path / "full")
        for shard in idx_full["shards"]:
            a, b = load_file(tmp_path / "full" / shard["file"]), load_file(tmp_path / other / shard["file"])
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (shard["file"], k)
    # Every row exactly once, in order.
    covered = [r for s in idx_full["shards"] for r in range(s["first"], s["first"] + len(s["lengths"]))]
    assert covered == list(range(len(rows)))
    assert [n for s in idx_full["shards"] for n in s["lengths"]] == [len(r) for r in rows]


def simulated_sessions(seed=0, sessions=3, turns=4, vocab=1000):
    """Multi-turn sessions (turn t prompt = all earlier turns + new part), a shared system prompt, a fork."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, 12)
    records = []
    for s in range(sessions):
        context = np.concatenate([system, rng.integers(0, vocab, 5)])
        for t in range(turns):
            out = rng.integers(0, vocab, int(rng.integers(3, 9)))
            records.append((context.copy(), out, f"s{s}"))
            context = np.concatenate([context, out, rng.integers(0, vocab, int(rng.integers(2, 6)))])
        if s == 0:  # a sub-agent forks from the middle of session 0
            fork = np.concatenate([records[1][0], rng.integers(0, vocab, 6)])
            records.append((fork, rng.integers(0, vocab, 4), "s0-sub"))
    tree = PrefixTree()
    for inp, out, sid in records:
        tree.add(inp, out, session_id=sid)
    return tree


def test_tree_capture_equals_per_path_forward_and_computes_each_token_once(capture, tmp_path):
    tree = simulated_sessions()
    stats = tree.stats()
    assert stats.leaves >= 4 and stats.edges > stats.leaves and stats.path_tokens > stats.unique_tokens
    computed = []
    counter = capture.decoder.embed_tokens.register_forward_hook(lambda m, a, o: computed.append(a[0].numel()))
    try:
        tstats = TreeCaptureStats()
        raw = {e.edge_id: (s, f) for e, s, f in iter_tree_features(tree, capture, chunk_tokens=7, stats=tstats)}
        assert sum(computed) == tstats.tokens_computed == stats.unique_tokens and tstats.strategy == "crop"
        computed.clear()
        res = write_tree_feature_cache(tree, capture, tmp_path / "t", dtype="bf16", shard_tokens=32, chunk_tokens=7,
                                       progress=False)
        assert sum(computed) == res.tokens_captured == stats.unique_tokens
        computed.clear()
        copied = {e.edge_id: (s, f) for e, s, f in iter_tree_features(tree, capture, chunk_tokens=7, strategy="copy")}
        assert sum(computed) == stats.unique_tokens
    finally:
        counter.remove()
    assert res.complete and res.segments == stats.edges
    reader = FeatureCacheReader(tmp_path / "t", dtype=torch.float32)
    assert len(reader) == stats.edges and reader.num_leaves == stats.leaves

    per_path = 0
    for path in tree.iter_paths(loss_once=False, drop_no_loss=False):
        ids = torch.tensor(path.input_ids, dtype=torch.long)[None]
        full = capture.capture(ids)  # what running every path from scratch computes
        per_path += ids.shape[1]
        leaf = reader.leaf_edge(path.leaf_id)
        chain = reader.path_edges(leaf)
        raw_sel = torch.cat([raw[e][0] for e in chain])
        raw_fin = torch.cat([raw[e][1] for e in chain])
        torch.testing.assert_close(raw_sel, full.selected[0], **FP32_TOL)  # fp32, before storage
        torch.testing.assert_close(raw_fin, full.final_hidden[0], **FP32_TOL)
        assert torch.equal(torch.cat([copied[e][0] for e in chain]), raw_sel)  # both strategies agree exactly
        sel, fin = reader.get_path(leaf)  # the stored bf16 cache, assembled
        assert torch.equal(sel, raw_sel.to(torch.bfloat16).float()) and torch.equal(fin, raw_fin.to(torch.bfloat16).float())
        torch.testing.assert_close(sel, full.selected[0], atol=1e-5, rtol=2**-8)
        assert torch.equal(reader.get_path_ids(leaf), torch.tensor(path.input_ids, dtype=torch.int32))
        # A window [a, b) of the path slices the FULL-context features (not a re-run of the window).
        a, b = 3, min(25, ids.shape[1])
        assert torch.equal(reader.get_path(leaf, a, b)[1], fin[a:b])
    assert per_path == stats.path_tokens > stats.unique_tokens

    # Windowed training rows made by the tree map onto the cache; a row from elsewhere does not.
    ds = tree.to_dataset(max_seq_len=16, overlap=4)
    reader.check_dataset(ds)
    for r in range(len(ds)):
        prov = ds[r]["provenance"]
        sel, _ = reader.get_window(prov["leaf_id"], prov["window_start"], len(ds[r]["input_ids"]))
        assert sel.shape[0] == len(ds[r]["input_ids"])
    bad = simulated_sessions(seed=1).to_dataset(max_seq_len=16, overlap=4)
    with pytest.raises(CacheMismatchError, match="does not match"):
        FeatureCacheReader(tmp_path / "t", bad)


def test_row_tree_serves_every_row_as_its_own_capture_and_computes_each_prefix_once(capture, tmp_path):
    """A training dataset's rows (turns of sessions: shared prefixes) through the tree of rows."""
    rows = [p.input_ids.tolist() for p in simulated_sessions(seed=5).iter_paths(loss_once=False, drop_no_loss=False)]
    rows += [rows[0][:20], list(rows[1]), []]  # a row that is a prefix of another, a duplicate, an empty row
    ds, max_len = make_dataset(rows), 40  # longer rows are cut: nothing past max_seq_len is computed or stored
    tree, where = row_prefix_tree(ds, max_len)
    bounded = [r[:max_len] for r in rows]
    assert any(len(r) > max_len for r in rows) and tree.unique_tokens < sum(map(len, bounded))
    computed = []
    counter = capture.decoder.embed_tokens.register_forward_hook(lambda m, a, o: computed.append(a[0].numel()))
    try:
        raw = {e.edge_id: (e, s, f) for e, s, f in iter_tree_features(tree, capture, chunk_tokens=16)}
        assert sum(computed) == tree.unique_tokens
        computed.clear()
        # The chunking of the raw pass above: the same forwards, so the cache must hold their exact bf16 rounding.
        res = write_row_tree_feature_cache(ds, capture, tmp_path / "one", max_seq_len=max_len, dtype="bf16",
                                           shard_tokens=40, chunk_tokens=16, progress=False)
        assert sum(computed) == res.tokens_captured == res.cached_tokens == tree.unique_tokens
        assert res.row_tokens == sum(map(len, bounded)) and res.complete
        computed.clear()
        kw = dict(max_seq_len=max_len, dtype="bf16", shard_tokens=40, progress=False)
        late = write_row_tree_feature_cache(ds, capture, tmp_path / "ranks", rank=1, world_size=2, **kw)
        first = write_row_tree_feature_cache(ds, capture, tmp_path / "ranks", rank=0, world_size=2, **kw)
        assert not late.complete and first.complete
        assert late.tokens_captured + first.tokens_captured == tree.unique_tokens
        assert sum(computed) == tree.unique_tokens + late.tokens_context + first.tokens_context  # context: <= one path
    finally:
        counter.remove()
    one = FeatureCacheReader(tmp_path / "one", ds, dtype=torch.float32)
    ranks = FeatureCacheReader(tmp_path / "ranks", ds, dtype=torch.float32)
    assert one.num_rows == len(rows)
    for r, ids in enumerate(bounded):
        sel, fin = one.get_row(r)
        assert sel.shape == (len(ids), len(LAYERS) * 64) and one.row_length(r) == len(ids)
        if not ids:
            continue
        plain = capture.capture(torch.tensor([ids]))  # the row alone, one full forward
        chain = one.path_edges(where["edge"][r])
        raw_sel = torch.cat([raw[e][1] for e in chain])[: len(ids)]
        raw_fin = torch.cat([raw[e][2] for e in chain])[: len(ids)]
        torch.testing.assert_close(raw_sel, plain.selected[0], **FP32_TOL)  # fp32, before storage
        torch.testing.assert_close(raw_fin, plain.final_hidden[0], **FP32_TOL)
        assert torch.equal(sel, raw_sel.to(torch.bfloat16).float()) and torch.equal(fin, raw_fin.to(torch.bfloat16).float())
        torch.testing.assert_close(ranks.get_row(r)[0], sel, atol=1e-5, rtol=2**-8)  # one bf16 rounding step
    with pytest.raises(CacheMismatchError, match="different dataset"):
        FeatureCacheReader(tmp_path / "one", make_dataset(rows[1:] + rows[:1]))


def test_sliding_window_target_falls_back_to_cache_copies(tmp_path):
    """Sliding-window layers cannot be cropped back once full: "auto" keeps per-depth cache copies."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    cap = HFCapture(MistralForCausalLM(config).eval(), [1, 3])
    tree = simulated_sessions(seed=4)
    stats = TreeCaptureStats()
    raw = {e.edge_id: (e, s) for e, s, _ in iter_tree_features(tree, cap, stats=stats)}
    assert stats.strategy == "copy" and stats.tokens_computed == tree.unique_tokens
    leaves = [eid for eid, (e, _) in raw.items() if e.is_leaf]
    for path, leaf in zip(tree.iter_paths(loss_once=False, drop_no_loss=False), leaves):
        chain, e = [], leaf
        while e != -1:
            chain.append(e)
            e = raw[e][0].parent_id
        got = torch.cat([raw[e][1] for e in reversed(chain)])
        full = cap.capture(torch.tensor(path.input_ids, dtype=torch.long)[None]).selected[0]
        torch.testing.assert_close(got, full, **FP32_TOL)
    with pytest.raises(RuntimeError, match="sliding window"):  # forcing crop fails loudly, never silently
        list(iter_tree_features(tree, cap, strategy="crop"))
    cap.remove()


def test_interrupted_tree_capture_resumes_exactly(capture, tmp_path):
    tree = simulated_sessions(seed=2)
    kw = dict(dtype="bf16", shard_tokens=24, progress=False)
    full = write_tree_feature_cache(tree, capture, tmp_path / "full", **kw)
    part = write_tree_feature_cache(tree, capture, tmp_path / "part", stop_after_shards=2, **kw)
    assert not part.complete and part.tokens_captured < full.tokens_captured
    rest = write_tree_feature_cache(tree, capture, tmp_path / "part", **kw)
    assert rest.complete and part.tokens_captured + rest.tokens_captured == full.tokens_captured
    assert rest.tokens_context > 0  # the first pending edge's ancestors were re-run, not stored
    idx_full = json.loads((tmp_path / "full" / "index.json").read_text())
    assert json.loads((tmp_path / "part" / "index.json").read_text()) == idx_full
    a, b = FeatureCacheReader(tmp_path / "full", dtype=torch.float32), FeatureCacheReader(tmp_path / "part", dtype=torch.float32)
    for leaf in range(a.num_leaves):
        # fp32 continuation vs a fresh prefix forward may differ by one bf16 rounding step.
        torch.testing.assert_close(b.get_path(b.leaf_edge(leaf))[0], a.get_path(a.leaf_edge(leaf))[0], atol=1e-5, rtol=2**-8)
    # Resuming with a different tree into the same folder is refused.
    with pytest.raises(CacheMismatchError, match="tree"):
        write_tree_feature_cache(simulated_sessions(seed=3), capture, tmp_path / "part", **kw)


def test_grown_dataset_copies_what_an_earlier_cache_holds_and_computes_only_the_new_tokens(capture, tmp_path):
    """Stage 2 on more sessions: the old sessions' features come from their cache, the target runs on the rest."""
    old = [p.input_ids.tolist() for p in simulated_sessions(seed=5).iter_paths(loss_once=False, drop_no_loss=False)]
    new = [p.input_ids.tolist() for p in simulated_sessions(seed=6).iter_paths(loss_once=False, drop_no_loss=False)]
    new += [old[0][:9] + [7, 8, 9], old[1][:30] + list(range(11, 25))]  # branch off an old edge and off an old row
    grown = old + new
    kw = dict(max_seq_len=40, dtype="bf16", shard_tokens=32, chunk_tokens=16, progress=False)
    write_row_tree_feature_cache(make_dataset(old), capture, tmp_path / "old", **kw)
    bounded = [tuple(r[:40]) for r in old]
    tree, _ = row_prefix_tree(make_dataset(grown), 40)
    edges = {e.edge_id: e for e in tree.iter_edges()}
    held = 0  # tokens of grown-tree edges whose whole root path is a prefix of an old row: what can be copied
    for e in edges.values():
        chain = [e]
        while chain[-1].parent_id != -1:
            chain.append(edges[chain[-1].parent_id])
        tokens = tuple(int(t) for a in reversed(chain) for t in a.tokens)
        if any(r[:len(tokens)] == tokens for r in bounded):
            held += len(e.tokens)
    assert 0 < held < tree.unique_tokens

    computed = []
    counter = capture.decoder.embed_tokens.register_forward_hook(lambda m, a, o: computed.append(a[0].numel()))
    try:
        earlier = EarlierFeatures([tmp_path / "old"])
        res = write_row_tree_feature_cache(make_dataset(grown), capture, tmp_path / "grown", known=earlier, **kw)
    finally:
        counter.remove()
    assert res.complete and res.tokens_reused == earlier.tokens_reused == held
    assert res.tokens_captured == tree.unique_tokens - held
    # The target ran on the new tokens, plus old ancestors once as the KV context of new branches.
    assert sum(computed) == res.tokens_captured + res.tokens_context and 0 < res.tokens_context <= 40 * len(new)
    fresh = write_row_tree_feature_cache(make_dataset(grown), capture, tmp_path / "fresh", **kw)
    assert fresh.tokens_reused == 0 and fresh.tokens_captured == tree.unique_tokens
    copied = FeatureCacheReader(tmp_path / "grown", make_dataset(grown), dtype=torch.float32)
    alone = FeatureCacheReader(tmp_path / "fresh", make_dataset(grown), dtype=torch.float32)
    for r in range(len(grown)):  # the same features as a capture from scratch, to one bf16 rounding step
        for got, want in zip(copied.get_row(r), alone.get_row(r)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=2**-8)


def test_grown_dataset_takes_the_target_choices_of_rows_an_earlier_cache_holds(capture, tmp_path):
    """The lm_head pass over a grown set's rows runs only on the new rows; the old rows' choices are copied."""
    from drafters.target.capture import Captured
    from train.batches import Batch
    from train.features import TargetChoices

    old = make_rows(n=6, seed=3, lo=10, hi=30)
    grown = make_rows(n=3, seed=4, lo=10, hi=30) + old  # new rows first: the old ones move to other indices
    kw = dict(max_seq_len=40, dtype="bf16", progress=False)
    write_row_tree_feature_cache(make_dataset(old), capture, tmp_path / "old", **kw)
    write_row_tree_feature_cache(make_dataset(grown), capture, tmp_path / "grown", **kw)
    head = capture.model.lm_head.weight

    def every_row(choices, folder, rows):
        reader = FeatureCacheReader(folder, make_dataset(rows), dtype=torch.float32)
        for i, ids in enumerate(rows):
            sel, fin = reader.get_row(i)
            batch = Batch([i], torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                          torch.ones(1, len(ids), dtype=torch.bool))
            choices(batch, Captured(sel[None], fin[None]))
        return choices

    every_row(TargetChoices(head, 64, store=tmp_path / "old" / "target_choices.safetensors", num_rows=len(old)),
              tmp_path / "old", old)
    grown_store = tmp_path / "grown" / "target_choices.safetensors"
    copied = every_row(TargetChoices(head, 64, store=grown_store, num_rows=len(grown), earlier=[tmp_path / "old"]),
                       tmp_path / "grown", grown)
    assert copied.copied_positions == sum(map(len, old))
    assert copied.projected_positions == sum(map(len, grown[:3]))
    grown_store.unlink()
    alone = every_row(TargetChoices(head, 64, store=grown_store, num_rows=len(grown)), tmp_path / "grown", grown)
    assert alone.copied_positions == 0 and alone.projected_positions == sum(map(len, grown))
    assert all(torch.equal(copied.rows[i], alone.rows[i]) for i in range(len(grown)))


def test_reader_refuses_a_cache_built_for_another_dataset(capture, rows, tmp_path):
    ds = make_dataset(rows)
    write_feature_cache(ds, capture, tmp_path / "c", shard_tokens=10_000, progress=False)
    FeatureCacheReader(tmp_path / "c", ds)  # the right one passes
    FeatureCacheReader(tmp_path / "c", ds.map(lambda r: {"category": "code"}))  # other columns do not matter
    with pytest.raises(CacheMismatchError, match=r"built for 14 rows, the dataset has 13"):
        FeatureCacheReader(tmp_path / "c", ds.select(range(13)))
    other = [list(r) for r in rows]
    other[7][0] = (other[7][0] + 1) % 1000  # one token differs
    with pytest.raises(CacheMismatchError, match="different dataset with the same row count"):
        FeatureCacheReader(tmp_path / "c", make_dataset(other))
    with pytest.raises(CacheMismatchError, match="different dataset"):  # same rows, other order
        FeatureCacheReader(tmp_path / "c", ds.select(list(range(1, 14)) + [0]))
    # Writing another dataset, dtype or layer set into the same folder is refused too.
    with pytest.raises(CacheMismatchError, match="dataset"):
        write_feature_cache(make_dataset(other), capture, tmp_path / "c", shard_tokens=10_000, progress=False)
    with pytest.raises(CacheMismatchError, match="dtype"):
        write_feature_cache(ds, capture, tmp_path / "c", dtype="fp8", shard_tokens=10_000, progress=False)
    res = write_feature_cache(make_dataset(other), capture, tmp_path / "c", shard_tokens=10_000, progress=False, overwrite=True)
    assert res.complete and res.tokens_captured == sum(map(len, other))
    FeatureCacheReader(tmp_path / "c", make_dataset(other))


def test_fp8_costs_about_half_the_bytes_per_token(capture, rows, tmp_path):
    from configs.schema import FeaturesConfig

    assert feature_cache_kwargs(FeaturesConfig(mode="offline", dtype="fp8")) == {"dtype": "fp8", "shard_tokens": 65_536}
    ds = make_dataset(rows)
    size = {}
    for dtype in ("bf16", "fp8"):
        write_feature_cache(ds, capture, tmp_path / dtype, dtype=dtype, shard_tokens=10_000, progress=False)
        reader = FeatureCacheReader(tmp_path / dtype)
        size[dtype] = reader.bytes_per_token
        payload = reader.feature_bytes_per_token * reader.num_tokens
        on_disk = sum(p.stat().st_size for p in (tmp_path / dtype).glob("shard-*"))
        assert payload <= on_disk <= payload + 4096  # tensors + a small safetensors header
    assert feature_bytes_per_token(4, 64, "bf16") == 5 * 64 * 2 + 4
    assert feature_bytes_per_token(4, 64, "fp8") == 5 * 64 + 5 * 4 + 4
    assert 0.5 <= size["fp8"] / size["bf16"] <= 0.56  # H = 64: scales + ids weigh a bit
    # At real widths the ratio approaches 1/2: SmolLM2 (K=5, H=576) and a Kimi-class target (K=5, H=7168).
    assert feature_bytes_per_token(5, 576, "fp8") / feature_bytes_per_token(5, 576, "bf16") == pytest.approx(0.504, abs=1e-3)
    assert feature_bytes_per_token(5, 7168, "fp8") / feature_bytes_per_token(5, 7168, "bf16") == pytest.approx(0.5, abs=1e-3)
