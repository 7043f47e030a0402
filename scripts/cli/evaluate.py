"""Acceptance length (tau) and speed of DFlash drafters by real speculative decoding against the target
(eval/acceptance.py; with the serving engine, eval/engine.py).

    dflash-pipeline eval --drafter outputs/testbed [--config CONFIG] [--traces code,prose] [section.key=value ...]

Each flag sets its config key (FLAG_KEYS); `--backend vllm` measures in the serving engine instead of our decoding
loop, and by default the config's engine block (`target.backend`) decides.
"""

from __future__ import annotations

import sys

from configs.schema import ConfigError, PipelineConfig, load_config, with_values
from eval.acceptance import eval_backend, evaluate
from eval.engine import evaluate_engine
from eval.inputs import EvalError
from eval.traces import TraceError
from scripts.cli.refusal import refuse

FLAG_KEYS = {"target": "target.path", "device_map": "target.device_map", "agentic_per_session": "eval.agentic_per_session",
             "max_prompts": "eval.max_prompts", "max_new_tokens": "eval.max_new_tokens", "max_tokens": "eval.max_tokens",
             "temperature": "eval.temperature", "reference_subset": "eval.reference_subset", "out": "eval.out",
             "dtype": "eval.dtype", "seed": "eval.seed", "max_chars": "eval.max_chars",
             "lookup_max_ngram": "eval.lookup_max_ngram", "lookup_num_draft": "eval.lookup_num_draft",
             "threads": "eval.threads"}


def add_arguments(p) -> None:
    p.add_argument("--drafter", action="append", default=[], metavar="[NAME=]CKPT",
                   help="drafter folder, training checkpoint (with drafter/), output_dir or FP8 export; repeatable")
    p.add_argument("--target", default=None, help="target model folder (default: config target.path, else the testbed target)")
    p.add_argument("--traces", default=None, help="comma-separated categories: code,prose,agentic,chat,writing (default: config eval.categories)")
    p.add_argument("--trajectories", action="append", default=[], metavar="FILE_OR_DIR",
                   help="held-out agent sessions (trajectory format, token ids); repeatable")
    p.add_argument("--agentic-per-session", type=int, default=None, help="last N requests of each session (default 1)")
    p.add_argument("--max-prompts", type=int, default=None, help="per category (default: config eval.max_prompts)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: config eval.max_new_tokens")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="per category budget of prompt tokens + max_new_tokens per prompt (default: no limit)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: config eval.temperature)")
    p.add_argument("--reference-subset", type=int, default=None,
                   help="prompts per category cross-checked with z-lab's dflash_generate (default: config eval.reference_subset)")
    p.add_argument("--out", default=None, help="report folder (default: <output_dir>/eval with --config, else outputs/eval)")
    p.add_argument("--config", default=None, help="pipeline YAML (configs/*.yaml); dotted overrides may follow")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                   help="target and drafter dtype (default float32: exact greedy comparisons; bfloat16 is faster on CPU)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-chars", type=int, default=None, help="held-out prompt size in characters (default 2000)")
    p.add_argument("--lookup-max-ngram", type=int, default=None)
    p.add_argument("--lookup-num-draft", type=int, default=None, help="default: the first drafter's block size - 1")
    p.add_argument("--no-sim", action="store_true", help="skip the teacher-forced estimate")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device-map", default=None, help="shard the target in-process, e.g. auto (default: config target.device_map)")
    p.add_argument("--backend", default=None, choices=["decoder", "vllm"],
                   help="decoder: our decoding loop on the HF target; vllm: the serving engine (eval/engine.py); "
                        "default: the config's engine block (target.backend: vllm -> vllm, hf -> decoder)")
    p.add_argument("--engine-url", default=None, help="vllm backend: a server already serving the drafter")
    p.add_argument("--engine-baseline-url", default=None, help="vllm backend: a server serving the target alone")
    p.add_argument("--wandb", action="store_true", help="log the summary and plots to wandb (project/mode from config logging)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. eval.max_prompts=4")


def config_from_args(args) -> tuple[PipelineConfig, list[str]]:
    """The config file and overrides, then the flags given (each sets its config key)."""
    config = load_config(args.config, args.overrides)
    values = {key: getattr(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}
    if args.traces:
        values["eval.categories"] = [c.strip() for c in args.traces.split(",") if c.strip()]
    if args.trajectories:
        values["eval.trajectories"] = list(args.trajectories)
    if args.no_sim:
        values["eval.simulate"] = False
    if args.no_warmup:
        values["eval.warmup"] = False
    if args.wandb:
        values["eval.wandb"] = True
    if not args.config and args.out is None and config.eval.out is None:
        values["eval.out"] = "outputs/eval"
    notes = []
    trajectories = values.get("eval.trajectories", config.eval.trajectories)
    if not args.traces and "agentic" in config.eval.categories and not trajectories:
        # from a config, not asked for explicitly: skip without a log
        values["eval.categories"] = [c for c in config.eval.categories if c != "agentic"]
        notes.append("agentic skipped: no --trajectories given")
    return with_values(config, values), notes


def run(args) -> int:
    try:
        config, notes = config_from_args(args)
        for note in notes:
            print(f"[eval] {note}", file=sys.stderr)
        if eval_backend(args.backend, config) == "vllm":
            evaluate_engine(args.drafter, config, args.engine_url, args.engine_baseline_url)
            return 0
        evaluate(args.drafter, config, notes=notes)
    except (EvalError, TraceError, ConfigError, FileNotFoundError) as err:
        return refuse(err, 2)
    return 0
