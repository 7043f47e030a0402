"""The counts of a simulated log: sessions, requests, tokens, prefix-tree dedup and prefix-cache reuse."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from data.trajectory.prefix_tree import build_prefix_tree
from data.trajectory.reader import TrajectoryRecord

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def prefix_reuse(records: Sequence[Any]) -> dict[str, Any]:
    """Prefix-cache reuse in log order: for each request, the longest prefix of its ``input_ids`` that
    is a prefix of an earlier request's ``input_ids + output_ids`` (what a radix cache holding every
    earlier request would serve). Returns the hit fraction over all input tokens and over inputs after
    the first request of each session."""
    seen: set[int] = set()
    hit = total = hit_later = total_later = 0
    first_of_session: set[str] = set()
    for rec in records:
        inp = [int(t) for t in rec.input_ids]
        hashes, h = [], 0
        for t in inp:
            h = (h * _BASE + t + 1) % _MOD
            hashes.append(h)
        lo, hi = 0, len(inp)  # largest k with prefix k seen (prefixes of seen sequences are all seen)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        hit += lo
        total += len(inp)
        if rec.session_id in first_of_session:
            hit_later += lo
            total_later += len(inp)
        first_of_session.add(rec.session_id)
        seen.update(hashes)
        for t in rec.output_ids:
            h = (h * _BASE + int(t) + 1) % _MOD
            seen.add(h)
    return {"prefix_reuse": hit / total if total else 0.0,
            "prefix_reuse_after_first_request": hit_later / total_later if total_later else 0.0,
            "cached_input_tokens": hit, "input_tokens": total}


def summarize_log(records: Sequence[TrajectoryRecord]) -> dict[str, Any]:
    """Counts of a log: sessions, requests, tokens, prefix-tree dedup and prefix reuse."""
    stats = build_prefix_tree(records).stats()
    kinds: dict[str, int] = {}
    for r in records:
        k = r.metadata.get("kind", "?")
        kinds[k] = kinds.get(k, 0) + 1
    sessions = {r.session_id for r in records}
    sub_sessions = {r.session_id for r in records if r.metadata.get("agent") == "sub"}
    spawning = {r.metadata.get("parent_session_id") for r in records if r.metadata.get("agent") == "sub"}
    per_session: dict[str, int] = {}
    for r in records:
        per_session[r.session_id] = per_session.get(r.session_id, 0) + 1
    main_turns = [n for s, n in per_session.items() if s not in sub_sessions]
    reuse = prefix_reuse(records)
    return {
        "sessions": len(sessions), "main_sessions": len(sessions - sub_sessions), "sub_sessions": len(sub_sessions),
        "sessions_spawning_subagents": len(spawning),
        "requests": len(records), "requests_by_kind": dict(sorted(kinds.items())),
        "compactions": kinds.get("compaction_request", 0),
        "requests_per_main_session_median": float(np.median(main_turns)) if main_turns else 0.0,
        "input_tokens": int(sum(r.input_ids.shape[0] for r in records)),
        "output_tokens": int(sum(r.output_ids.shape[0] for r in records)),
        "input_tokens_median": float(np.median([r.input_ids.shape[0] for r in records])) if records else 0.0,
        "output_tokens_median": float(np.median([r.output_ids.shape[0] for r in records])) if records else 0.0,
        "finished_outputs": sum(r.metadata.get("finish_reason") == "stop" for r in records),
        "logged_tokens": stats.logged_tokens, "unique_tokens": stats.unique_tokens,
        "unique_generated_tokens": stats.unique_generated_tokens, "dedup_ratio": round(stats.dedup_ratio, 4),
        "tree_leaves": stats.leaves, "max_path_len": stats.max_path_len,
        "prefix_reuse": round(reuse["prefix_reuse"], 4),
        "prefix_reuse_after_first_request": round(reuse["prefix_reuse_after_first_request"], 4),
    }
