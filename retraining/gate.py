"""The promotion gate: the current and the candidate drafter evaluated on the same held-out traffic, and the verdict.

Where tau comes from follows the config's engine block (`target.backend`):

* hf (the default): greedy, real speculative decoding against the target in process (``eval.acceptance.evaluate``),
  every output compared with the target's own greedy output;
* vllm: both drafters served by the engine (``eval.engine``, the engine settings of `target:`, eval.dtype from
  `retrain.eval`), tau from its speculative-decoding counters. The candidate is served as its bf16 export, what
  promotion would serve. Exactness is still checked: with `retrain.serving_check` the candidate's served outputs
  are held to the target's greedy output from the Python decoder (``eval.engine.serving_check``, one engine for
  both; the target then also runs in process, as the serving check needs), else to the engine's own target-alone
  outputs, and the target runs only in the engine (a Kimi-size target: leave `retrain.serving_check` off).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from common.atomic_files import write_json_atomic
from configs.schema import PipelineConfig
from drafters.export.exporter import export_drafter
from eval.acceptance import evaluate
from eval.engine import evaluate_engine, serving_check
from retraining.records import Cycle


def gate_eval_config(cycle: Cycle, heldout_files: list[str], out: Path) -> PipelineConfig:
    """The gate's eval (retrain.eval) on the held-out files, with the run's target placed as the run places it
    (target.device_map: a sharded Kimi-size target stays sharded)."""
    gate_config = cycle.config.model_copy(deep=True)
    gate_config.target.path = str(cycle.target_path)
    gate_config.eval = cycle.config.retrain.eval.model_copy(update={"trajectories": list(heldout_files), "out": str(out)})
    return gate_config


def evaluate_pair(cycle: Cycle, candidate: Path, window: list[str]) -> dict:
    """The current and the candidate drafter on the same held-out traffic (eval.acceptance.evaluate, or the engine
    when target.backend is vllm); its report."""
    if cycle.config.target.backend == "vllm":
        return evaluate_pair_engine(cycle, candidate, window)
    t0 = time.time()
    eval_dir = cycle.dir / "eval"
    report = None
    if (eval_dir / "report.json").exists():
        report = json.loads((eval_dir / "report.json").read_text())
        names = {d["name"]: d["folder"] for d in report.get("drafters", [])}
        if names != {"current": str(cycle.current_drafter), "candidate": str(candidate)}:
            report = None
    if report is None:
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
    mismatched = record["eval"]["mismatched_candidate"]
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
    if rc.serving_check and "serving_check" in record:  # the engine gate ran it on the engine it measured
        if not record["serving_check"]["passed"]:
            return ("the candidate's bf16 export failed the vLLM serving check "
                    f"({cdir / 'serving-check' / 'serving_check.json'})")
    elif rc.serving_check:  # the engine must serve the candidate as the decoder measured it (eval/engine.py)

        export_drafter(candidate, cdir / "serving-check" / "bf16", "bf16", overwrite=True)
        check = serving_check(cdir / "serving-check" / "bf16", gate_eval_config(cycle, window, cdir / "serving-check"),
                              log=cycle.log)
        record["serving_check"] = {k: check[k] for k in ("passed", "identical", "prompts", "tau_engine", "tau_decoder")}
        if not check["passed"]:
            return ("the candidate's bf16 export failed the vLLM serving check "
                    f"({cdir / 'serving-check' / 'serving_check.json'})")
    return None


def served_folder(drafter_dir: Path) -> Path:
    """What the engine serves for a version's drafter: its bf16 export beside it when there is one."""
    export = drafter_dir.parent / "bf16"
    return export if (export / "config.json").is_file() else drafter_dir


def evaluate_pair_engine(cycle: Cycle, candidate: Path, window: list[str]) -> dict:
    """The gate through the engine (target.backend: vllm): tau of the current drafter and of the candidate's bf16
    export from vLLM's counters on the same held-out traffic, and the candidate's exactness; returns the candidate's
    engine report (its serving check's, with retrain.serving_check)."""
    t0 = time.time()
    rc, record, cdir = cycle.config.retrain, cycle.record, cycle.dir
    current = served_folder(cycle.current_drafter)
    export = cdir / "serving-check" / "bf16"
    marker = cdir / "eval" / "engine_gate.json"
    done = json.loads(marker.read_text()) if marker.exists() else None
    if done is None or done.get("current") != str(current) or done.get("candidate") != str(candidate):
        if not (export / "config.json").is_file():
            export_drafter(candidate, export, "bf16", overwrite=True)
        cur = evaluate_engine([f"current={current}"], gate_eval_config(cycle, window, cdir / "eval"), log=cycle.log,
                              include_target=False)
        check_config = gate_eval_config(cycle, window, cdir / "serving-check")
        if rc.serving_check:  # one engine: the gate's tau and the serving check's exactness
            check = serving_check(export, check_config, log=cycle.log)
            cand = {"tau": check["tau_engine"], "prompts": check["prompts"],
                    "mismatched": len(check["mismatches"]), "mismatches": check["mismatches"],
                    "backend": check["backend"], "compared_with": "the target's greedy output (Python decoder)"}
            serving = {k: check[k] for k in ("passed", "identical", "prompts", "tau_engine", "tau_decoder")}
        else:
            report = evaluate_engine([f"candidate={export}"], check_config, log=cycle.log)
            method = report["methods"]["candidate"]
            prompts = method["all"]["prompts"]
            cand = {"tau": method["all"]["tau"], "prompts": prompts,
                    "mismatched": prompts - method["identical_to_target"], "mismatches": [],
                    "backend": method["backend"], "compared_with": "the engine's target-alone output"}
            serving = None
        method = cur["methods"]["current"]
        done = {"current": str(current), "candidate": str(candidate), "export": str(export),
                "tau_current": method["all"]["tau"], "prompts": method["all"]["prompts"],
                "backend_current": method["backend"], "candidate_engine": cand, "serving_check": serving}
        write_json_atomic(marker, done)
    cand = done["candidate_engine"]
    tau_cur, tau_cand = done["tau_current"], cand["tau"]
    record["tau_current"], record["tau_candidate"] = tau_cur, tau_cand
    record["eval"] = {
        "backend": "vllm", "engine_current": done["backend_current"], "engine_candidate": cand["backend"],
        "served_current": done["current"], "served_candidate": done["export"],
        "prompts": cand["prompts"], "heldout_files": window, "max_new_tokens": rc.eval.max_new_tokens,
        "tau_current": tau_cur, "tau_candidate": tau_cand, "tau_source": "engine counters (1 + accepted / drafts)",
        "tau_prompt_lookup": None,
        "tau_gain": (tau_cand / tau_cur - 1.0) if tau_cur and tau_cand is not None else None,
        "mismatched_current": None, "mismatched_candidate": cand["mismatched"], "exactness": cand["compared_with"],
        "mismatches": cand["mismatches"], "report": str(marker)}
    if done["serving_check"] is not None:
        record["serving_check"] = done["serving_check"]
    cycle.phase["eval"] = time.time() - t0
    if cand["mismatched"]:
        cycle.log(f"[retrain] WARNING: the served candidate's greedy output differs from {cand['compared_with']} on "
                  f"{cand['mismatched']} held-out prompt(s)")
    return done
