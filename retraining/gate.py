"""The promotion gate: the current and the candidate drafter evaluated on the same held-out traffic (greedy, real
speculative decoding against the target, ``eval.acceptance.evaluate``), and the verdict."""

from __future__ import annotations

import json
import time
from pathlib import Path

from configs.schema import PipelineConfig
from retraining.records import Cycle


def gate_eval_config(cycle: Cycle, heldout_files: list[str], out: Path) -> PipelineConfig:
    """The gate's eval (retrain.eval) on the held-out files, with the run's target placed as the run places it
    (target.device_map: a sharded Kimi-size target stays sharded)."""
    gate_config = cycle.config.model_copy(deep=True)
    gate_config.target.path = str(cycle.target_path)
    gate_config.eval = cycle.config.retrain.eval.model_copy(update={"agentic_log": list(heldout_files), "out": str(out)})
    return gate_config


def evaluate_pair(cycle: Cycle, candidate: Path, window: list[str]) -> dict:
    """The current and the candidate drafter on the same held-out traffic (eval.acceptance.evaluate); its report."""
    t0 = time.time()
    eval_dir = cycle.dir / "eval"
    report = None
    if (eval_dir / "report.json").exists():
        report = json.loads((eval_dir / "report.json").read_text())
        names = {d["name"]: d["folder"] for d in report.get("drafters", [])}
        if names != {"current": str(cycle.current_drafter), "candidate": str(candidate)}:
            report = None
    if report is None:
        from eval.acceptance import evaluate

        report = evaluate([f"current={cycle.current_drafter}", f"candidate={candidate}"],
                          gate_eval_config(cycle, window, eval_dir), log=cycle.log)
    cat = report["categories"]["agentic"]
    methods = cat["methods"]
    cur, cand, lookup = methods["current"], methods["candidate"], methods.get("prompt_lookup", {})
    tau_cur, tau_cand = cur["tau_mean"], cand["tau_mean"]
    record = cycle.record
    record["tau_current"], record["tau_candidate"] = tau_cur, tau_cand
    record["eval"] = {
        "prompts": cat["prompts"], "prompt_tokens": cat["prompt_tokens"], "heldout_files": window,
        "max_new_tokens": cycle.config.retrain.eval.max_new_tokens, "tau_current": tau_cur, "tau_candidate": tau_cand,
        "tau_prompt_lookup": lookup.get("tau_mean"),
        "tau_gain": (tau_cand / tau_cur - 1.0) if tau_cur and tau_cand is not None else None,
        "mismatched_current": cur.get("mismatched", 0), "mismatched_candidate": cand.get("mismatched", 0),
        "mismatches": report.get("mismatches", []), "report": str(eval_dir / "report.json")}
    cycle.phase["eval"] = time.time() - t0
    if report.get("mismatches"):
        cycle.log(f"[retrain] WARNING: T=0 output mismatches vs the target's greedy output: {report['mismatches']}")
    return report


def gate(cycle: Cycle, candidate: Path, report: dict, window: list[str]) -> str | None:
    """Why the candidate is not promoted, or None: it must beat the current drafter's tau by the margin, reproduce
    the target's greedy output, and (retrain.serving_check) serve in vLLM as the decoder measured it."""
    rc, record, cdir, current = cycle.config.retrain, cycle.record, cycle.dir, cycle.current_version
    tau_cur, tau_cand = record["tau_current"], record["tau_candidate"]
    mismatched = report["categories"]["agentic"]["methods"]["candidate"].get("mismatched", 0)
    margin = rc.promotion_margin
    required = tau_cur * (1.0 + margin) if tau_cur is not None else None
    record["gate"] = {"margin": margin, "required_tau": required}
    if tau_cand is None or tau_cur is None:
        return "no decode step was measured on the held-out traffic"
    if rc.require_identical_outputs and mismatched:
        return (f"the candidate's greedy output differs from the target's on {mismatched} held-out prompt(s) "
                "(retrain.require_identical_outputs)")
    if not tau_cand > required:
        return (f"candidate tau {tau_cand:.3f} does not beat current {current} tau {tau_cur:.3f} by the margin "
                f"{margin:.1%} (needs > {required:.3f}); {current} stays current")
    if rc.serving_check:  # the engine must serve the candidate as the decoder measured it (eval/engine.py)
        from drafters.export import export_drafter
        from eval.engine import serving_check

        export_drafter(candidate, cdir / "serving-check" / "bf16", "bf16", overwrite=True)
        check = serving_check(cdir / "serving-check" / "bf16", gate_eval_config(cycle, window, cdir / "serving-check"),
                              log=cycle.log)
        record["serving_check"] = {k: check[k] for k in ("passed", "identical", "prompts", "tau_engine", "tau_decoder")}
        if not check["passed"]:
            return ("the candidate's bf16 export failed the vLLM serving check "
                    f"({cdir / 'serving-check' / 'serving_check.json'})")
    return None
