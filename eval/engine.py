"""The serving engine in the eval: `dflash-pipeline eval --backend vllm` (`evaluate_engine`) and the serving check
of an export (`serving_check`); the engine itself is engines/vllm/engine.py.

`evaluate_engine` decodes the same trace sets as the Python decoder, each drafter served as a DFlash speculator,
then the target alone; the report names the backend of every figure. `serving_check` loads an export in the engine
and holds it to the Python decoder on the same prompts: greedy outputs token for token equal to the target's, tau
within 2%.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from common.atomic_files import write_json_atomic
from common.dtypes import dtype_name, torch_dtype
from configs.schema import EvalConfig, PipelineConfig, TargetConfig, with_values
from engines.hf.generation import stop_token_ids
from engines.settings import vllm_kwargs
from engines.vllm.engine import (
    Engine,
    InProcessEngine,
    engine_for,
    run_traces,
    summarize_runs,
)
from eval.acceptance import evaluate, settings_record
from eval.inputs import EvalError, prepare, report_dir

TAU_TOLERANCE = 0.02


def eval_engine_kwargs(config) -> dict:
    """The eval's in-process engine from the config's engine block (`target:`; engines/settings.py):
    parallelism, quantization, remote code and, when set, the memory share and context length. The dtype is
    eval.dtype's (float32 by default: greedy outputs compare token for token with the decoder's)."""
    settings = vllm_kwargs(config.target, "", max_model_len=config.target.max_model_len or 2048)
    kwargs = {key: settings[key] for key in ("tensor_parallel_size", "pipeline_parallel_size", "trust_remote_code",
                                             "enable_expert_parallel", "quantization") if key in settings}
    kwargs["dtype"] = dtype_name(torch_dtype(config.eval.dtype))
    if config.target.memory_share is not None:
        kwargs["memory_fraction"] = config.target.memory_share
    if config.target.max_model_len is not None:
        kwargs["max_model_len"] = config.target.max_model_len
    return kwargs


def check_engine_context(trace_sets: dict, max_new_tokens: int, max_model_len: int) -> None:
    """Refuse, before an engine starts, a prompt the engine's context cannot hold with its new tokens."""
    longest = max(((t.num_tokens, c, t.id) for c, ts in trace_sets.items() for t in ts.traces), default=None)
    if longest and longest[0] + max_new_tokens > max_model_len:
        tokens, category, trace_id = longest
        raise EvalError(f"{category} prompt {trace_id} has {tokens} tokens: with eval.max_new_tokens={max_new_tokens} "
                        f"it does not fit the engine's context target.max_model_len={max_model_len}; raise "
                        "target.max_model_len or lower eval.max_chars / eval.max_tokens")


def evaluate_engine(drafter_args: list[str], config, engine_url: str | None = None,
                    baseline_url: str | None = None, log=print, engine_kwargs: dict | None = None,
                    include_target: bool = True) -> dict:
    """tau and tokens/s of each drafter served by vLLM, and the target alone, on eval.acceptance's traces.

    In process: one engine per drafter, then one for the target alone, started one after the other
    (``include_target=False`` leaves the target alone out: the retrain gate's current drafter needs only its tau).
    With ``engine_url`` (one drafter, already served there) and ``baseline_url`` (the target alone) the
    same measurements run against those servers. Writes report.json and report.md under the eval's report_dir.
    """
    settings = config.eval
    specs, target_path, target_config, tokenizer, trace_sets, notes = prepare(drafter_args, config, log)
    if engine_url and len(specs) != 1:
        raise EvalError(f"--engine-url serves one drafter; {len(specs)} were given")
    engine_kwargs = {**eval_engine_kwargs(config), **(engine_kwargs or {})}
    if not engine_url:
        check_engine_context(trace_sets, settings.max_new_tokens, engine_kwargs.get("max_model_len", 2048))
    stop_ids = stop_token_ids(target_path, tokenizer)
    out_dir = report_dir(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods: dict[str, dict] = {}
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    plan = [(s.name, s.folder, engine_url) for s in specs]
    if include_target:
        plan.append(("target", None, baseline_url))
    for name, folder, url in plan:
        started = time.perf_counter()
        with engine_for(target_path, folder, url, engine_kwargs) as engine:
            startup = time.perf_counter() - started
            runs = run_traces(engine, trace_sets, settings.max_new_tokens, stop_ids, settings.temperature,
                              settings.seed, log)
            methods[name] = {"backend": engine.backend, "startup_seconds": startup if not url else None,
                             "categories": {c: summarize_runs(r, engine.backend) for c, r in runs.items()},
                             "all": summarize_runs([x for r in runs.values() for x in r], engine.backend),
                             "prompts": {c: [{"id": t.id, **{k: v for k, v in asdict(r).items() if k != "tokens"},
                                              "new_tokens": len(r.tokens), "tau": r.tau}
                                             for t, r in zip(trace_sets[c].traces, rs)] for c, rs in runs.items()}}
            outputs[name] = {c: [r.tokens for r in rs] for c, rs in runs.items()}
    greedy = settings.temperature <= 0
    for name in methods if include_target else []:
        if greedy and name != "target":
            same = sum(a == b for c in outputs[name] for a, b in zip(outputs[name][c], outputs["target"][c]))
            methods[name]["identical_to_target"] = same
        base = methods["target"]["all"]["tokens_per_s_e2e"]
        own = methods[name]["all"]["tokens_per_s_e2e"]
        methods[name]["speedup_e2e"] = own / base if own and base else None
    report = {"backend": "vllm", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "target": str(target_path),
              "drafters": [s.describe() for s in specs], "settings": {**settings_record(config), "stop_ids": stop_ids},
              "categories": {c: ts.describe() for c, ts in trace_sets.items()}, "methods": methods, "notes": notes}
    write_json_atomic(out_dir / "report.json", report)
    (out_dir / "report.md").write_text(engine_report_markdown(report))
    log(engine_report_markdown(report))
    return report


def engine_report_markdown(report: dict) -> str:
    lines = ["# Acceptance through the serving engine", "",
             f"Target `{report['target']}`; every figure below was produced by the backend named in its row.", "",
             "| method | backend | category | prompts | new tokens | tau (engine counters) | tau (delivered per "
             "step) | tok/s e2e | identical to target |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in report["methods"].items():
        for category, s in {**m["categories"], "all": m["all"]}.items():
            tau = f"{s['tau']:.3f}" if s["tau"] is not None else "-"
            delivered = f"{s['tau_delivered']:.3f}" if s["tau_delivered"] is not None else "-"
            tps = f"{s['tokens_per_s_e2e']:.1f}" if s["tokens_per_s_e2e"] else "-"
            same = m.get("identical_to_target", "-") if category == "all" else ""
            lines.append(f"| {name} | {m['backend']} | {category} | {s['prompts']} | {s['new_tokens']} | {tau} | {delivered} | "
                         f"{tps} | {same} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Serving check of an export
# --------------------------------------------------------------------------------------------------


def serving_check(export_dir: str | Path, config, *, engine: Engine | None = None, log=print,
                  engine_kwargs: dict | None = None) -> dict:
    """Serve `export_dir` as a DFlash speculator and hold it to the Python decoder on the same prompts.

    Runs `eval.acceptance.evaluate` (config: target, eval traces, max_new_tokens; T = 0) for the target's
    greedy outputs and the decoder's tau, then the engine with the export. Passes when every served output
    equals the target's greedy output and the engine's tau is within 2% of the decoder's. `engine` reuses
    an engine already serving this export. Writes serving_check.json under the eval's report_dir; returns its content.
    """
    export_dir = Path(export_dir)
    if config.eval.temperature > 0:
        raise ValueError("the serving check compares greedy outputs: temperature must be 0")
    if json.loads((export_dir / "config.json").read_text()).get("quantization_config"):
        config = with_values(config, {"eval.dtype": "bf16"})  # vLLM's FP8 layers take bf16/fp16 only
    settings = config.eval
    decoder = evaluate([f"export={export_dir}"], config, log=lambda *a, **k: None)
    truth = {(p["category"], p["id"]): p["results"]["target"]["output_ids"] for p in decoder["prompts"]}
    specs_tau = decoder["categories"].get("all", next(iter(decoder["categories"].values())))["methods"]["export"]
    tau_decoder = specs_tau["tau_mean"]
    _, target_path, _, tokenizer, trace_sets, _ = prepare([str(export_dir)], config, lambda *a, **k: None)
    stop_ids = decoder["settings"]["stop_ids"]
    own = engine is None
    if own:
        engine = InProcessEngine(target_path, export_dir, **{**eval_engine_kwargs(config), **(engine_kwargs or {})})
    try:
        runs = run_traces(engine, trace_sets, settings.max_new_tokens, stop_ids, 0.0, settings.seed, log)
    finally:
        if own:
            engine.close()
    prompts, mismatched = [], []
    for category, rs in runs.items():
        for trace, run in zip(trace_sets[category].traces, rs):
            expected = truth[(category, trace.id)]
            same = run.tokens == expected
            prompts.append({"category": category, "id": trace.id, "identical": same, "tau": run.tau,
                            "drafts": run.drafts, "accepted": run.accepted, "new_tokens": len(run.tokens)})
            if not same:
                diff = next((i for i, (a, b) in enumerate(zip(run.tokens, expected)) if a != b),
                            min(len(run.tokens), len(expected)))
                mismatched.append({"category": category, "id": trace.id, "first_diff": diff,
                                   "engine": run.tokens[diff: diff + 8], "target": expected[diff: diff + 8]})
    all_runs = [r for rs in runs.values() for r in rs]
    engine_summary = summarize_runs(all_runs, engine.backend)
    tau_engine, tau_delivered = engine_summary["tau"], engine_summary["tau_delivered"]

    def rel(value):
        return (value - tau_decoder) / tau_decoder if value is not None and tau_decoder else None

    result = {"export": str(export_dir), "target": str(target_path), "backend": engine.backend,
              "prompts": len(all_runs), "identical": len(all_runs) - len(mismatched), "mismatches": mismatched,
              "tau_engine": tau_engine, "tau_engine_delivered": tau_delivered, "tau_decoder": tau_decoder,
              "tau_rel_diff": rel(tau_engine), "tau_delivered_rel_diff": rel(tau_delivered),
              "drafts_engine": engine_summary["drafts"], "steps_decoder": specs_tau["steps"],
              "tau_tolerance": TAU_TOLERANCE, "engine": engine_summary, "per_prompt": prompts}
    # The counters also count drafts accepted past max_tokens or a stop token, which the engine then
    # drops; the decoder truncates its last step. Tokens delivered per engine step is the decoder's
    # definition, so the check holds that one to 2% (and reports both).
    delivered_rel = result["tau_delivered_rel_diff"]
    result["passed"] = not mismatched and delivered_rel is not None and abs(delivered_rel) <= TAU_TOLERANCE
    out = report_dir(config)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "serving_check.json", result)
    verdict = "passed" if result["passed"] else "FAILED"
    log(f"[serving-check] {verdict}: {export_dir} on {engine.backend}: {result['identical']}/{len(all_runs)} outputs "
        f"identical to the target's greedy output; tau engine {tau_engine} (counters), {tau_delivered} "
        f"(delivered tokens per step) vs decoder {tau_decoder} "
        f"(goal within {TAU_TOLERANCE:.0%})")
    return result


def serving_check_config(out: str | Path, target: str | None = None, *, categories=("code", "prose"),
                         trajectories: list[str] | None = None, max_prompts: int = 4, max_new_tokens: int = 64,
                         cache_dir: str | None = None):
    """The config of a serving check: greedy, fp32, no teacher-forced estimate, no reference decoder, no lookup."""
    return PipelineConfig(cache_dir=cache_dir, target=TargetConfig(path=target), eval=EvalConfig(
        categories=list(categories), trajectories=list(trajectories or []), max_prompts=max_prompts,
        max_new_tokens=max_new_tokens, reference_subset=0, simulate=False, warmup=False, out=str(out),
        with_lookup_min_match=None))
