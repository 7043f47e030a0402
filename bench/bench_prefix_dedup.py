"""Benchmark: prefix dedup of simulated coding-agent traffic.

Simulates logs shaped like production agentic traffic (see /work/shared/dflash-facts.md, "Why
coding-agent traffic"): sessions of 43 turns whose prompt is all previous turns + a short new part
(tool results, occasionally a large file dump), outputs of a few hundred tokens, a system prompt shared
by all sessions of an agent, ~44% of sessions spawning sub-agents (median 4) that fork from the parent's
context, some sessions compacting their context (-> a branch). Token ids are random (the tree only
compares ids). Sizes are scaled down from production (142K-token median prompts) so the run takes
< 1 minute on 2 CPU cores; the dedup ratio grows with prompt length, so production is higher.

Pipeline measured: write the logs (JSONL.gz and Parquet, atomic writer), ingest them with
``TrajectoryReader`` (JSON parse + validation + quarantine accounting), build the prefix tree, make the
windowed training paths. Prints ONE JSON line on stdout.

    python bench/bench_prefix_dedup.py            # defaults (~20 s here)
    python bench/bench_prefix_dedup.py --sessions 8 --max-seq-len 3072

``--through-training`` instead runs stage-2 training itself (``train.loop.train``, one step,
``features.mode: offline``) on the simulated logs with a tiny random target of Kimi's vocabulary, and
reports what the target computed to build the feature cache (counted at the target's forward) against
the unique tokens of the training rows, the unique tokens of the logs, the rows' tokens (what a
per-row capture computes) and the logged tokens. Prints ONE JSON line.

    python bench/bench_prefix_dedup.py --through-training --sessions 6 --max-seq-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np


from data.trajectory.prefix_tree import PrefixTree
from data.trajectory.reader import TrajectoryReader, TrajectoryRecord, write_trajectories


def _ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    a = rng.integers(0, vocab, int(n), dtype=np.int32)
    a.flags.writeable = False
    return a


def simulate_agentic_traffic(
    sessions: int = 24,
    *,
    turns: int = 43,
    system_tokens: int = 3000,
    new_median: int = 250,
    output_median: int = 300,
    big_dump_prob: float = 0.12,
    subagent_prob: float = 0.44,
    subagents_median: int = 4,
    subagent_turns: int = 8,
    compaction_prob: float = 0.15,
    vocab: int = 163_840,
    seed: int = 0,
) -> list[TrajectoryRecord]:
    """Records in timestamp order (sub-agent requests interleaved after their spawning request)."""
    rng = np.random.default_rng(seed)
    systems = [_ids(rng, system_tokens, vocab) for _ in range(2)]  # two agents, each with its own system prompt
    records: list[TrajectoryRecord] = []
    clock = 1_760_000_000.0

    def new_part() -> int:
        if rng.random() < big_dump_prob:  # a file read / test log pasted by a tool
            return int(rng.integers(1000, 3000))
        return max(8, int(rng.lognormal(np.log(new_median), 0.6)))

    def out_len() -> int:
        return max(16, int(rng.lognormal(np.log(output_median), 0.5)))

    def emit(sid: str, rid: str, parent: str | None, inp: np.ndarray, out: np.ndarray, agent: str, turn: int):
        nonlocal clock
        clock += float(rng.uniform(1, 30))
        inp.flags.writeable = False
        records.append(
            TrajectoryRecord(sid, rid, inp, out, clock, parent, {"agent": agent, "turn": turn})
        )

    for s in range(sessions):
        sid = f"sess{s:04d}"
        hist = systems[s % 2]
        compact_at = int(rng.integers(20, turns)) if rng.random() < compaction_prob else -1
        n_sub = max(1, int(rng.poisson(subagents_median))) if rng.random() < subagent_prob else 0
        spawn_turns = set(rng.choice(np.arange(2, turns), size=min(n_sub, turns - 2), replace=False).tolist())
        prev = None
        for t in range(turns):
            if t == compact_at:  # context compaction: system prompt + a summary replaces the history
                hist = np.concatenate([systems[s % 2], _ids(rng, 600, vocab)])
            inp = np.concatenate([hist, _ids(rng, new_part(), vocab)])
            out = _ids(rng, out_len(), vocab)
            rid = f"{sid}-t{t:02d}"
            emit(sid, rid, prev, inp, out, "main", t)
            if t in spawn_turns:  # the output is a tool call that spawns a sub-agent with the parent's context
                sub_sid = f"{sid}-sub{t:02d}"
                sh = np.concatenate([inp, out, _ids(rng, 150, vocab)])
                sprev = rid
                for u in range(subagent_turns):
                    so = _ids(rng, out_len(), vocab)
                    srid = f"{sub_sid}-t{u:02d}"
                    emit(sub_sid, srid, sprev, sh, so, "sub", u)
                    sprev = srid
                    sh = np.concatenate([sh, so, _ids(rng, new_part(), vocab)])
            hist = np.concatenate([inp, out])
            prev = rid
    return records


def through_training(records: list[TrajectoryRecord], work: Path, max_seq_len: int, vocab: int) -> dict:
    """Stage-2 training on the logs, one step; the feature cache's capture figures."""
    import torch

    from configs.schema import load_config
    from drafters.drafter.checkpoint import save_drafter
    from drafters.drafter.model import DFlashDrafter
    from drafters.target.loading import load_target_config
    from drafters.target.testbed import tiny_llama_target
    from train.loop import train
    from train.setup import build_draft_config

    log = work / "logs" / "traffic.jsonl.gz"
    write_trajectories(records, log, compresslevel=1)
    tiny_llama_target(vocab_size=vocab).save_pretrained(work / "target")
    overrides = [f"output_dir={work / 'train'}", f"target.path={work / 'target'}", f"data.trajectories=[{log}]",
                 f"data.max_seq_len={max_seq_len}", f"cache_dir={work / 'cache'}", "drafter.mask_token_id=3",
                 "drafter.num_layers=1", "drafter.num_target_features=3", "train.max_steps=1", "train.batch_size=1",
                 "train.anchors_per_seq=4", "train.anchor_scope=loss_mask", "train.loss=kl", "train.head_vocab=null",
                 f"train.cpu_threads={torch.get_num_threads()}",
                 "logging.wandb=false"]
    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "testbed-finetune.yaml", overrides)
    stage1 = DFlashDrafter(build_draft_config(config, work / "target", load_target_config(work / "target")))
    save_drafter(stage1, work / "stage1", dtype=torch.bfloat16)  # an untrained stage-1 drafter to fine-tune
    config.train.init_from = str(work / "stage1")
    t0 = time.perf_counter()
    train(config)
    seconds = time.perf_counter() - t0
    capture = json.loads((work / "train" / "feature_capture.json").read_text())
    tree = json.loads((work / "train" / "trajectory_summary.json").read_text())["tree"]
    computed = capture["target_tokens"]
    return {
        "bench": "prefix_dedup_through_training",
        "requests": tree["requests"],
        "max_seq_len": max_seq_len,
        "logged_tokens": tree["logged_tokens"],
        "unique_tokens_logs": tree["unique_tokens"],
        "training_rows": capture["rows"],
        "tree_edges": capture["segments"],
        "row_tokens": capture["row_tokens"],
        "unique_tokens_rows": capture["cached_tokens"],
        "target_tokens_computed": computed,
        "computed_equals_unique_rows": computed == capture["cached_tokens"],
        "computed_over_unique_logs": round(computed / tree["unique_tokens"], 4),
        "row_tokens_over_computed": round(capture["row_tokens"] / computed, 2),
        "logged_over_computed": round(tree["logged_tokens"] / computed, 2),
        "capture_tokens_per_s": round(capture["tokens_per_s"]),
        "train_s": round(seconds, 1),
        "cpu_count": os.cpu_count(),
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=43)
    ap.add_argument("--system-tokens", type=int, default=3000)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=163_840)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where to write the logs (default: a temp dir, removed)")
    ap.add_argument("--through-training", action="store_true", help="run stage-2 training on the logs (see above)")
    return ap.parse_args()


def write_logs(records, work: Path) -> tuple[Path, Path, dict]:
    """The same traffic as JSONL.gz and as Parquet, and how long each write took."""
    gz, pq_path = work / "traffic.jsonl.gz", work / "traffic.parquet"
    t0 = time.perf_counter()
    write_trajectories(records, gz, compresslevel=1)
    t_write_gz = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_trajectories(records, pq_path, row_group_size=128)
    t_write_pq = time.perf_counter() - t0
    return gz, pq_path, {"write_jsonl_gz_s": round(t_write_gz, 2), "write_parquet_s": round(t_write_pq, 2)}


def ingest_into_tree(gz: Path, vocab: int, work: Path):
    """Stream JSONL.gz into a prefix tree, timing reading+validation and insertion separately.

    Returns the tree, the reader, the two times, and the share of prompt tokens a prefix cache of
    unbounded capacity would have served."""
    reader = TrajectoryReader([gz], vocab, quarantine_path=work / "quarantine.jsonl")
    tree = PrefixTree()
    t_read = t_build = 0.0
    prompt_tokens = uncached_prompt = 0
    it = iter(reader)
    while True:
        a = time.perf_counter()
        rec = next(it, None)
        b = time.perf_counter()
        t_read += b - a
        if rec is None:
            break
        before = tree.unique_tokens
        tree.add_record(rec)
        t_build += time.perf_counter() - b
        # Prompt tokens not already in the tree (outputs are random, hence always new): what a
        # prefix cache with unbounded capacity would have to prefill.
        prompt_tokens += rec.input_ids.size
        uncached_prompt += max(0, tree.unique_tokens - before - rec.output_ids.size)
    reader.summary.check()
    return tree, reader, t_read, t_build, 1 - uncached_prompt / prompt_tokens


def read_parquet(pq_path: Path, vocab: int) -> tuple[int, float]:
    """Parquet ingestion (read + validate only): records read and seconds."""
    t0 = time.perf_counter()
    pq_reader = TrajectoryReader([pq_path], vocab)
    n_pq = sum(1 for _ in pq_reader)
    seconds = time.perf_counter() - t0
    pq_reader.summary.check()
    return n_pq, seconds


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    records = simulate_agentic_traffic(
        args.sessions, turns=args.turns, system_tokens=args.system_tokens, vocab=args.vocab, seed=args.seed
    )
    t_sim = time.perf_counter() - t0

    tmp = tempfile.TemporaryDirectory() if args.workdir is None else None
    work = Path(args.workdir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    if args.through_training:
        result = through_training(records, work, args.max_seq_len, args.vocab)
        if tmp is not None:
            tmp.cleanup()
        print(json.dumps(result))
        return
    gz, pq_path, write_times = write_logs(records, work)
    n_sub_sessions = len({r.session_id for r in records if "-sub" in r.session_id})
    del records

    tree, reader, t_read, t_build, prompt_prefix_reuse = ingest_into_tree(gz, args.vocab, work)
    t0 = time.perf_counter()
    st = tree.stats()
    t_compact = time.perf_counter() - t0
    t0 = time.perf_counter()
    windows = list(tree.iter_paths(args.max_seq_len))
    t_paths = time.perf_counter() - t0
    window_tokens = sum(len(w.input_ids) for w in windows)
    n_pq, t_read_pq = read_parquet(pq_path, args.vocab)
    sizes = {"jsonl_gz_mb": round(gz.stat().st_size / 2**20, 1), "parquet_mb": round(pq_path.stat().st_size / 2**20, 1)}
    if tmp is not None:
        tmp.cleanup()

    logged = st.logged_tokens
    result = {
        "bench": "prefix_dedup",
        "sessions": args.sessions,
        "subagent_sessions": n_sub_sessions,
        "turns": args.turns,
        "requests": st.requests,
        "quarantined": reader.summary.quarantined,
        "logged_tokens": logged,
        "unique_tokens": st.unique_tokens,
        "dedup_ratio": round(st.dedup_ratio, 2),
        "leaves": st.leaves,
        "edges": st.edges,
        "max_path_len": st.max_path_len,
        "measured_prompt_prefix_reuse": round(prompt_prefix_reuse, 4),
        "per_path_tokens_no_kv_reuse": st.path_tokens,
        "max_seq_len": args.max_seq_len,
        "window_rows": len(windows),
        "window_tokens": window_tokens,
        "logged_over_window_tokens": round(logged / window_tokens, 2),
        "loss_tokens": sum(int(w.loss_mask.sum()) for w in windows),
        "unique_generated_tokens": st.unique_generated_tokens,
        "goal_20x_met": st.dedup_ratio >= 20 and logged / window_tokens >= 20,
        "simulate_s": round(t_sim, 2),
        **write_times,
        "ingest_jsonl_gz_s": round(t_read, 2),
        "ingest_jsonl_gz_tokens_per_s": round(logged / t_read),
        "ingest_parquet_s": round(t_read_pq, 2),
        "ingest_parquet_tokens_per_s": round(logged / t_read_pq),
        "build_s": round(t_build + t_compact, 3),
        "build_tokens_per_s": round(logged / (t_build + t_compact)),
        "paths_s": round(t_paths, 3),
        **sizes,
        "cpu_count": os.cpu_count(),
    }
    assert n_pq == st.requests
    print(json.dumps(result))


if __name__ == "__main__":
    main()
