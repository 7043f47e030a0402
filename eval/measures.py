"""What an evaluation measures from its decodes: exactness against the target, the teacher-forced estimate,
and the pooled figures of each method per category (see eval/README.md for the report's fields)."""

from __future__ import annotations

import statistics

import torch

from drafters.decoding.spec_decode import Decoded
from drafters.drafter.objective import (
    acceptance_stats,
    block_loss,
    block_targets,
    default_gamma,
)

TARGET = "target"
LOOKUP = "prompt_lookup"
SIM_ANCHOR_CHUNK = 64  # anchors per teacher-forced forward (bounds the block attention's memory)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing new token (the shorter length if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatch(method: str, category: str, prompt_id: str, truth: list[int], tokens: list[int], diff: int) -> dict:
    """One T = 0 output that differs from the target's own greedy output, from its first differing token."""
    return {"method": method, "category": category, "prompt_id": prompt_id, "first_diff": diff,
            "target_new_tokens": len(truth), "method_new_tokens": len(tokens),
            "target_tokens_at_diff": truth[diff: diff + 8], "method_tokens_at_diff": tokens[diff: diff + 8]}


@torch.no_grad()
def teacher_forced_slots(drafter, head, features: torch.Tensor, sequence: torch.Tensor, n_prompt: int):
    """Blocks anchored at every position of the continuation (the target's own output), teacher forced.

    features [1, T, K*H] (the drafter's layers over the whole sequence); sequence [1, T] = prompt +
    continuation. Anchor a = n_prompt .. T-2 (the first generated token is the first anchor, as in
    decoding); slot k is right when the draft argmax equals the token at a + k. Returns (slot_correct,
    slot_valid), each [N, B-1], or None when the continuation has fewer than 2 tokens.
    """
    seq_len = sequence.shape[1]
    if seq_len - 1 <= n_prompt:
        return None
    block = drafter.block_size
    loss_mask = torch.zeros_like(sequence, dtype=torch.bool)
    loss_mask[:, n_prompt:] = True
    corrects, valids = [], []
    for lo in range(n_prompt, seq_len - 1, SIM_ANCHOR_CHUNK):
        anchors = torch.arange(lo, min(lo + SIM_ANCHOR_CHUNK, seq_len - 1), device=sequence.device)[None]
        hidden = drafter(features, sequence, anchors, head.embed)
        targets = block_targets(anchors, torch.ones_like(anchors, dtype=torch.bool), loss_mask, block)
        out = block_loss(hidden, targets, None, sequence, head.lm_head.weight, gamma=default_gamma(block), kind="ce")
        corrects.append(out.slot_correct[0])
        valids.append(out.slot_valid[0])
    return torch.cat(corrects), torch.cat(valids)


def summarize_method(runs: list[Decoded], target_runs: list[Decoded], block_size: int | None) -> dict:
    """Pooled metrics of one method on one category (and the same prompts' target-alone runs)."""
    steps = [s for r in runs for s in r.acceptance_lengths]
    decode_tokens = sum(steps)
    new_tokens = sum(len(r.tokens) for r in runs)
    prefill = sum(r.prefill_seconds for r in runs)
    total = sum(r.total_seconds for r in runs)
    decode = max(total - prefill, 1e-9)
    tps = decode_tokens / decode if decode_tokens else None
    tps_e2e = new_tokens / total if total > 0 else None
    t_steps = sum(s for r in target_runs for s in r.acceptance_lengths)
    t_decode = max(sum(r.total_seconds - r.prefill_seconds for r in target_runs), 1e-9)
    t_tps = t_steps / t_decode if t_steps else None
    t_tps_e2e = sum(len(r.tokens) for r in target_runs) / max(sum(r.total_seconds for r in target_runs), 1e-9)
    curve = []
    if block_size and block_size > 1 and steps:
        curve = [sum(1 for s in steps if s - 1 >= k) / len(steps) for k in range(1, block_size)]
    per_prompt = [r.tau for r in runs if r.acceptance_lengths]
    return {
        "prompts": len(runs),
        "new_tokens": new_tokens,
        "steps": len(steps),
        "tau_mean": decode_tokens / len(steps) if steps else None,
        "tau_median": float(statistics.median(steps)) if steps else None,
        "tau_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "slot_acceptance": curve,
        "prefill_seconds": prefill,
        "decode_seconds": decode,
        "total_seconds": total,
        "tokens_per_s": tps,
        "tokens_per_s_e2e": tps_e2e,
        "speedup": tps / t_tps if tps and t_tps else None,
        "speedup_e2e": tps_e2e / t_tps_e2e if tps_e2e and t_tps_e2e else None,
    }


def summarize_simulation(slots: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The teacher-forced estimate over a category's prompts: (slot_correct, slot_valid) per prompt."""
    stats = acceptance_stats(torch.cat([c for c, _ in slots]), torch.cat([v for _, v in slots]))
    return {"sim_tau": stats["sim_tau"], "sim_slot_accuracy": stats["slot_accuracy"],
            "sim_blocks": int(sum(int(v[:, 0].sum()) for _, v in slots))}


def summarize_reference(rows: list[tuple[Decoded, Decoded, dict]], greedy: bool) -> dict:
    """Ours against z-lab's decoder on the same prompts: rows of (ours, theirs, per-prompt comparison)."""
    ours_steps = [s for o, _, _ in rows for s in o.acceptance_lengths]
    ref_steps = [s for _, t, _ in rows for s in t.acceptance_lengths]
    tau_ours = sum(ours_steps) / len(ours_steps) if ours_steps else None
    tau_ref = sum(ref_steps) / len(ref_steps) if ref_steps else None
    rel = (tau_ours - tau_ref) / tau_ref if tau_ours is not None and tau_ref else None
    summary = {"prompts": len(rows), "tau_ours": tau_ours, "tau_reference": tau_ref,
               "rel_diff": rel, "within_2pct": rel is not None and abs(rel) <= 0.02,
               "acceptance_lengths_equal": sum(r["acceptance_lengths_equal"] for _, _, r in rows)}
    if greedy:
        summary["outputs_identical_to_ours"] = sum(r["identical_to_ours"] for _, _, r in rows)
        summary["outputs_identical_to_target"] = sum(r["identical_to_target"] for _, _, r in rows)
    ref_t = sum(t.total_seconds - t.prefill_seconds for _, t, _ in rows)
    summary["reference_tokens_per_s"] = sum(ref_steps) / ref_t if ref_t > 0 and ref_steps else None
    return summary


def summarize_category(runs: dict[str, list[Decoded]], sims: dict[str, list], refs: dict[str, list],
                       block_sizes: dict[str, int], greedy: bool) -> dict:
    """Every method's pooled figures on one category; runs in the report's method order."""
    summary = {}
    for method, method_runs in runs.items():
        s = summarize_method(method_runs, runs[TARGET], block_sizes[method])
        if greedy and method != TARGET:
            s["identical"] = sum(r.tokens == t.tokens for r, t in zip(method_runs, runs[TARGET]))
            s["mismatched"] = s["prompts"] - s["identical"]
        summary[method] = s
    for name, slots in sims.items():
        if slots:
            summary[name].update(summarize_simulation(slots))
    for name, rows in refs.items():
        if rows:
            summary[name]["reference"] = summarize_reference(rows, greedy)
    return summary
