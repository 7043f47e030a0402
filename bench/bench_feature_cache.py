"""Offline feature cache on the SmolLM2-135M testbed target (K = 5 layers [1, 8, 14, 20, 27], H = 576).

  python bench/bench_feature_cache.py [--seqs 6] [--min-len 128] [--max-len 384] [--sessions 3] [--turns 6]

Measures, and prints as ONE JSON line on stdout:
  rows   bytes per token of the bf16 and the fp8 cache (on disk, and the tensor payload), capture
         tokens/s (target forward + quantise + atomic shard writes), reader tokens/s, and the fp8
         error vs the bf16 cache (relative RMS per tensor), next to what ONE scale per token over the
         concatenated K layers would give (why the cache scales each layer separately).
  tree   a prefix tree of simulated multi-turn sessions (random ids; turn t's prompt = all earlier
         turns + a new part; one sub-agent forks from a session's context), written as trajectory
         logs and read back with data.trajectory.reader, then: target tokens computed by the tree capture
         (each unique token once) vs capturing every request on its own (what the logs hold) vs every
         root-to-leaf path from scratch; wall time of tree capture vs per-request capture; and the
         difference between a request's features assembled from tree edges and captured directly.
The target runs in bf16 (3.3x faster than fp32 matmuls on this CPU), one intra-op thread by default
(see --threads). Runtime about 30-60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np


LAYER_IDS = [1, 8, 14, 20, 27]


def simulate_sessions(sessions: int, turns: int, vocab: int, seed: int = 0):
    """TrajectoryRecords: `sessions` sessions of `turns` turns sharing a system prompt; session 0 spawns a
    sub-agent (3 turns) that starts from its turn-2 context."""
    from data.trajectory.reader import TrajectoryRecord

    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(0, vocab, int(n), dtype=np.int32)  # noqa: E731
    system = ids(64)
    records, clock = [], 1_760_000_000.0
    for s in range(sessions):
        hist, prev = system, None
        for t in range(turns):
            inp = np.concatenate([hist, ids(rng.integers(20, 60))])
            out = ids(rng.integers(30, 80))
            clock += 5
            rid = f"s{s}-t{t}"
            records.append(TrajectoryRecord(f"s{s}", rid, inp, out, clock, prev, {"turn": t}))
            if s == 0 and t == 2:
                sub, sprev = np.concatenate([inp, out, ids(40)]), rid
                for u in range(3):
                    so = ids(rng.integers(30, 60))
                    clock += 5
                    records.append(TrajectoryRecord("s0-sub", f"s0-sub-t{u}", sub, so, clock, sprev, {"turn": u}))
                    sprev = f"s0-sub-t{u}"
                    sub = np.concatenate([sub, so, ids(rng.integers(10, 30))])
            hist, prev = np.concatenate([inp, out]), rid
    return records


def rel_rms(a, b) -> float:
    return float(((a - b).float().pow(2).mean() / b.float().pow(2).mean().clamp_min(1e-30)).sqrt())


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=6)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads; 1 by default: on this shared 2-core box 2 threads ran 4-10x slower "
                         "whenever other processes were busy (0 = torch's default)")
    ap.add_argument("--workdir", default=None, help="where to write the caches (default: a temp dir, removed)")
    return ap.parse_args()


def measure_rows(capture, args, work: Path, vocab: int, hidden: int) -> dict:
    """Bytes per token and capture speed of the bf16 and fp8 caches, and fp8's error against bf16."""
    import datasets
    import torch

    from data.feature_cache import FeatureCacheReader, dequantize_fp8, quantize_fp8, write_feature_cache

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(args.min_len, args.max_len + 1, args.seqs)]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]})
    rows_report, readers = {}, {}
    for dtype in ("bf16", "fp8"):
        res = write_feature_cache(ds, capture, work / f"rows-{dtype}", dtype=dtype, shard_tokens=1024,
                                  batch_size=args.batch_size, progress=False, overwrite=True)
        reader = FeatureCacheReader(work / f"rows-{dtype}", ds, dtype=torch.float32)
        t0 = time.perf_counter()
        for i in range(len(reader)):
            reader.get(i, torch.bfloat16)
        t_read = time.perf_counter() - t0
        readers[dtype] = reader
        rows_report[dtype] = {
            "bytes_per_token_on_disk": round(reader.bytes_per_token, 1),
            "payload_bytes_per_token": reader.feature_bytes_per_token,
            "capture_tokens_per_s": round(res.tokens_per_s, 1),
            "capture_seconds": round(res.seconds, 2),
            "padded_tokens": res.padded_tokens,
            "shards": res.shards_total,
            "read_tokens_per_s": round(reader.num_tokens / t_read, 1),
        }
    k = len(LAYER_IDS)
    err_layer = [[] for _ in range(k)]
    err_final, err_one_scale = [], [[] for _ in range(k)]
    for i in range(len(ds)):
        ref_sel, ref_fin = readers["bf16"].get(i)
        q_sel, q_fin = readers["fp8"].get(i)
        one = dequantize_fp8(*quantize_fp8(ref_sel, 1))  # the alternative: one scale per token over K*H
        for j in range(k):
            sl = slice(j * hidden, (j + 1) * hidden)
            err_layer[j].append(rel_rms(q_sel[:, sl], ref_sel[:, sl]))
            err_one_scale[j].append(rel_rms(one[:, sl], ref_sel[:, sl]))
        err_final.append(rel_rms(q_fin, ref_fin))
    rows_report.update(
        sequences=len(rows), tokens=int(sum(map(len, rows))),
        fp8_over_bf16_bytes=round(rows_report["fp8"]["bytes_per_token_on_disk"] / rows_report["bf16"]["bytes_per_token_on_disk"], 4),
        fp8_rel_rms_err_per_layer=[round(float(np.mean(e)), 4) for e in err_layer],
        fp8_rel_rms_err_final=round(float(np.mean(err_final)), 4),
        fp8_rel_rms_err_if_one_scale_per_token=[round(float(np.mean(e)), 4) for e in err_one_scale],
    )
    return rows_report


def measure_tree(capture, args, work: Path, vocab: int) -> dict:
    """Simulated sessions through the trajectory logs: tree capture against per-request capture."""
    import datasets
    import torch

    from data.feature_cache import FeatureCacheReader, write_feature_cache, write_tree_feature_cache
    from data.trajectory.prefix_tree import PrefixTree
    from data.trajectory.reader import load_trajectories, write_trajectories

    records = simulate_sessions(args.sessions, args.turns, vocab)
    log = work / "sessions.jsonl.gz"
    write_trajectories(records, log)
    loaded, summary = load_trajectories([log], vocab)
    tree = PrefixTree.from_records(loaded)
    stats = tree.stats()
    tres = write_tree_feature_cache(tree, capture, work / "tree", dtype="bf16", shard_tokens=4096, progress=False,
                                    overwrite=True)
    req_rows = [np.concatenate([r.input_ids, r.output_ids]).tolist() for r in loaded]
    req_ds = datasets.Dataset.from_dict({"input_ids": req_rows})
    rres = write_feature_cache(req_ds, capture, work / "requests", dtype="bf16", shard_tokens=4096,
                               batch_size=args.batch_size, progress=False, overwrite=True)
    # A request's features assembled from tree edges vs the same request captured on its own.
    treader = FeatureCacheReader(work / "tree", dtype=torch.float32)
    rreader = FeatureCacheReader(work / "requests", req_ds, dtype=torch.float32)
    row_of = {r.request_id: i for i, r in enumerate(loaded)}
    diffs, checked = [], set()
    for path in tree.iter_paths(loss_once=False, drop_no_loss=False):
        for rid in path.request_ids:
            if rid in checked:
                continue
            checked.add(rid)
            i = row_of[rid]
            n = len(req_rows[i])
            assert np.array_equal(path.input_ids[:n], req_rows[i])
            t_sel, t_fin = treader.get_path(treader.leaf_edge(path.leaf_id), 0, n)
            r_sel, r_fin = rreader.get(i)
            diffs.append((rel_rms(t_sel, r_sel), rel_rms(t_fin, r_fin)))
    return {
        "records_read": summary.accepted,
        "sessions": len({r.session_id for r in loaded}),
        "requests": stats.requests,
        "edges": stats.edges,
        "leaves": stats.leaves,
        "target_tokens_tree_capture": tres.tokens_captured,
        "unique_tokens": stats.unique_tokens,
        "target_tokens_per_request": stats.logged_tokens,
        "target_tokens_per_path": stats.path_tokens,
        "per_request_over_tree": round(stats.logged_tokens / tres.tokens_captured, 2),
        "tree_capture_seconds": round(tres.seconds, 2),
        "per_request_capture_seconds": round(rres.seconds, 2),
        "tree_tokens_per_s": round(tres.tokens_per_s, 1),
        "requests_checked": len(diffs),
        "tree_vs_direct_rel_rms_selected_max": round(max(d[0] for d in diffs), 5),
        "tree_vs_direct_rel_rms_final_max": round(max(d[1] for d in diffs), 5),
    }


def main() -> None:
    args = parse_args()

    import datasets
    import torch
    from transformers import AutoModelForCausalLM

    from drafters.target.capture import HFCapture
    from drafters.target.testbed import prepare_testbed_target

    if args.threads:
        torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    t_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(prepare_testbed_target(), dtype=torch.bfloat16).eval()
    capture = HFCapture(model, LAYER_IDS)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    capture.capture(torch.randint(0, vocab, (1, 32)))  # warm-up
    tmp = tempfile.TemporaryDirectory() if args.workdir is None else None
    work = Path(args.workdir or tmp.name)
    report: dict = {"target": "SmolLM2-135M-Instruct (bf16)", "layer_ids": LAYER_IDS, "hidden_size": hidden,
                    "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    report["rows"] = measure_rows(capture, args, work, vocab, hidden)
    report["tree"] = measure_tree(capture, args, work, vocab)
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
