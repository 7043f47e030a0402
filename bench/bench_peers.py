"""Peers side by side: our trainer, SpecForge's and speculators', on the same data, shape and minutes.

    python -m bench.bench_peers --minutes 15 --out outputs/bench/peers [--config configs/testbed.yaml] [key=value ...]

1. Prepare once, with our pipeline: the regenerated mixture of the config and its offline bf16 feature cache
   (reused when already in the cache), and the drafter config (shape, block size, target layers, mask token).
2. Export those rows and features into each peer's own offline format (bench/peers/export.py).
3. Calibrate: each trainer runs a few steps; its startup and steady step time give the steps that fit the
   budget, so that every trainer's LR schedule ends inside the same wall-clock minutes.
4. Train each for the budget, in turn, alone on the machine, as its own process (ours: train/dflash.py;
   SpecForge: `specforge train` itself, bench/peers/specforge_run.py; speculators: its model, loss, data and
   optimizer in a plain loop, bench/peers/speculators_loop.py, because its Trainer cannot run on a CPU).
   Wall time, steps and peak memory (the process tree's max RSS) are measured here.
5. Decode the held-out prompts with ONE decoder, ours (dflash-pipeline eval), for every final drafter;
   every output is checked against the target's greedy output. Optionally (--curves) score every snapshot
   teacher forced (bench/bench_learning_curve.py) for the learning curves.

Writes OUT/peers.json and OUT/peers.md. The peers live in their own virtual environments (their pins clash with
ours: SpecForge pins torch 2.11, transformers 5.8.1 and sglang 0.5.14): --specforge-python and
--speculators-python (defaults: /work/peers/<peer>-venv/bin/python); docs/peers.md says how to make them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINERS = ("ours", "specforge", "speculators")
PEER_PYTHON = {"specforge": "/work/peers/specforge-venv/bin/python",
               "speculators": "/work/peers/speculators-venv/bin/python"}


# --------------------------------------------------------------------------------------------------
# 1-2. Prepare with our pipeline, export to the peers
# --------------------------------------------------------------------------------------------------

def final_norm_weight(target_path: Path):
    """The target's final RMSNorm weight, read from its safetensors (single file or sharded)."""
    from safetensors import safe_open

    names = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")
    for file in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    raise ValueError(f"{target_path}: no final norm weight ({', '.join(names)}) in its safetensors")


def check_room(out: Path, tokens: int, reader, peers: list[str]) -> None:
    """Refuse, before writing, exports the disk cannot hold: each peer gets every token's features in bf16
    (speculators one layer more), plus a quarter for the formats' own overhead."""
    layers_bytes = 2 * len(reader.layer_ids) * reader.hidden_size
    need = int(1.25 * tokens * sum(layers_bytes + (2 * reader.hidden_size if p == "speculators" else 0) for p in peers))
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if need > free:
        raise SystemExit(f"error: the peers' exports need about {need / 1e9:.1f} GB under {out}, and "
                         f"{free / 1e9:.1f} GB are free")


def prepare(config_path: str, overrides: list[str], out: Path, peers: list[str], log=print) -> dict:
    from accelerate import Accelerator

    from bench.peers.export import export_specforge, export_speculators
    from configs.schema import load_config
    from drafters.drafter.checkpoint import config_dict
    from drafters.drafter.model import dflash_settings
    from drafters.target.loading import load_target_config
    from train.features import feature_source
    from train.setup import cache_root, resolve_draft_config, resolve_target, training_dataset

    started = time.perf_counter()
    config = load_config(config_path, [*overrides, f"output_dir={out / 'prep'}", "logging.wandb=false"])
    target_path = resolve_target(config, log)
    target_config = load_target_config(target_path, config.target.trust_remote_code)
    draft_config = resolve_draft_config(config, target_path, target_config)
    layer_ids, mask_token_id, block_size = dflash_settings(draft_config)
    accelerator = Accelerator(cpu=True)
    dataset = training_dataset(config, target_path, accelerator, layer_ids)
    features = feature_source(config, dataset, target_path, layer_ids, accelerator, cache_root(config))
    prepared = time.perf_counter()
    draft_config_path = out / "draft-config.json"
    draft_config_path.write_text(json.dumps(config_dict(draft_config), indent=2, sort_keys=True) + "\n")
    exports = {}
    max_len = config.data.max_seq_len
    check_room(out, sum(min(len(ids), max_len) for ids in dataset["input_ids"]), features.reader, peers)
    if "specforge" in peers:
        exports["specforge"] = export_specforge(dataset, features.reader, max_len, out / "data" / "specforge")
    if "speculators" in peers:
        exports["speculators"] = export_speculators(dataset, features.reader, max_len, final_norm_weight(target_path),
                                                    out / "data" / "speculators")
    return {"target": str(target_path), "draft_config": str(draft_config_path), "layer_ids": layer_ids,
            "mask_token_id": int(mask_token_id), "block_size": block_size,
            "num_layers": draft_config.num_hidden_layers, "rows": len(dataset),
            "tokens": sum(min(len(ids), max_len) for ids in dataset["input_ids"]),
            "feature_cache": str(features.reader.out_dir), "max_seq_len": max_len,
            "batch_size": config.train.batch_size, "prepare_seconds": round(prepared - started, 1),
            "export_seconds": round(time.perf_counter() - prepared, 1), "exports": exports}


# --------------------------------------------------------------------------------------------------
# 3-4. The trainers' command lines, measured runs, calibration
# --------------------------------------------------------------------------------------------------

def specforge_recipe(prep: dict, out: Path, run: Path, batch_size: int, anchors: int) -> Path:
    """SpecForge's offline DFlash recipe (examples/configs/qwen3-8b-dflash-offline.yaml: batch 4, lr 6e-4,
    warmup 0.04, grad clip 1.0, 512 anchors, cosine) with our drafter shape and data; gamma 4, the paper's
    value for blocks of 8 (their recipe's 7 is for blocks of 16). NO_SHARD and sdpa: see specforge_run.py."""
    import yaml

    recipe = {
        "model": {"target_model_path": prep["target"], "draft_model_config": prep["draft_config"],
                  "embedding_key": "model.embed_tokens.weight", "torch_dtype": "bfloat16",
                  "mask_token_id": prep["mask_token_id"]},
        "data": {"hidden_states_path": str(out / "data" / "specforge"), "max_length": prep["max_seq_len"],
                 "cache_dir": str(run / "cache"), "dataloader_num_workers": 0},
        "training": {"strategy": "dflash", "num_epochs": 1000, "batch_size": batch_size, "learning_rate": 6.0e-4,
                     "warmup_ratio": 0.04, "max_grad_norm": 1.0, "attention_backend": "sdpa", "num_anchors": anchors,
                     "loss_decay_gamma": 4.0, "log_interval": 1, "seed": 42, "fsdp_sharding": "NO_SHARD"},
        "run_id": "peers-specforge", "output_dir": str(run / "checkpoints"),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }
    path = run / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def command(name: str, prep: dict, args, out: Path, run: Path, steps: int, snapshot_every: int) -> list[str]:
    if name == "ours":
        return [sys.executable, str(REPO / "train" / "dflash.py"), "--config", args.config, *args.overrides,
                f"output_dir={run}", f"train.max_steps={steps}", f"train.snapshot_every={snapshot_every}",
                f"train.cpu_threads={args.threads}", "logging.wandb=false"]
    if name == "specforge":
        recipe = specforge_recipe(prep, out, run, prep["batch_size"], args.peer_anchors)
        return [args.specforge_python, str(REPO / "bench" / "peers" / "specforge_run.py"), "--out", str(run),
                "--recipe", str(recipe), f"training.max_steps={steps}", f"training.save_interval={snapshot_every}"]
    from bench.peers.export import speculators_train_ratio

    samples = prep["exports"]["speculators"]["samples"]
    return [args.speculators_python, str(REPO / "bench" / "peers" / "speculators_loop.py"), "--out", str(run),
            "--snapshot-every", str(snapshot_every), "--time-limit", str(args.minutes * 60 * 1.5), "--",
            "--verifier-name-or-path", prep["target"], "--data-path", str(out / "data" / "speculators"),
            "--save-path", str(run / "save"), "--speculator-type", "dflash", "--draft-config", prep["draft_config"],
            "--block-size", str(prep["block_size"]), "--target-layer-ids", *map(str, prep["layer_ids"]),
            "--mask-token-id", str(prep["mask_token_id"]), "--draft-attn-impl", "sdpa",
            "--loss-implementation", "eager", "--num-workers", "0", "--on-missing", "raise",
            "--train-data-ratio", repr(speculators_train_ratio(samples)), "--max-anchors", str(args.peer_anchors),
            "--max-steps", str(steps)]


def run_measured(cmd: list[str], log_path: Path, threads: int, timeout: float) -> dict:
    """Run cmd in its own session; wall seconds, exit status and the peak RSS of its process tree (wait4)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - started > timeout and not timed_out:
                timed_out = True
                os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"returncode": proc.returncode, "timed_out": timed_out, "wall_seconds": time.perf_counter() - started,
            "peak_rss_gib": usage.ru_maxrss / 2**20}


def snapshot_times(run: Path) -> list[tuple[int, float]]:
    times = []
    for folder in sorted((run / "snapshots").glob("step-*")):
        state = folder / "trainer_state.json"
        if state.exists():
            s = json.loads(state.read_text())
            times.append((int(s["step"]), float(s["elapsed_seconds"])))
    return times


def step_timing(name: str, run: Path, measured: dict) -> tuple[float, float]:
    """(startup seconds, steady seconds per step) of a finished run."""
    if name == "ours":
        times = snapshot_times(run)
        (s0, t0), (s1, t1) = times[0], times[-1]
        per_step = (t1 - t0) / max(s1 - s0, 1)
        return max(measured["wall_seconds"] - s1 * per_step, 0.0), per_step
    result = json.loads((run / "result.json").read_text())
    steps = result["step_seconds"]
    per_step = sum(steps[1:]) / (len(steps) - 1) if len(steps) > 1 else steps[0]
    return max(measured["wall_seconds"] - sum(steps), 0.0), per_step


def train_one(name: str, prep: dict, args, out: Path, steps: int, snapshot_every: int, tag: str, timeout: float) -> dict:
    run = out / tag / name
    done = run / "measured.json"
    if args.resume and done.exists():
        print(f"[peers] {tag} {name}: reusing {done}", flush=True)
        return json.loads(done.read_text())
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    cmd = command(name, prep, args, out, run, steps, snapshot_every)
    print(f"[peers] {tag} {name}: {steps} steps", flush=True)
    measured = run_measured(cmd, run / "run.log", args.threads, timeout)
    if measured["returncode"] != 0:
        tail = "\n".join((run / "run.log").read_text().splitlines()[-20:])
        raise RuntimeError(f"{name} ({tag}) exited with {measured['returncode']}; log {run / 'run.log'}:\n{tail}")
    if name == "specforge":  # the wrapper's own wall excludes exporting the checkpoints for our decoder
        measured["wall_seconds"] = json.loads((run / "result.json").read_text())["wall_seconds"]
    measured["startup_seconds"], measured["step_seconds"] = step_timing(name, run, measured)
    measured.update(run=str(run), steps=steps, command=cmd)
    done.write_text(json.dumps(measured, indent=2) + "\n")
    return measured


def budget_steps(startup: float, per_step: float, budget_seconds: float) -> int:
    return max(1, math.floor((budget_seconds - startup) / per_step))


# --------------------------------------------------------------------------------------------------
# 5. One decoder for every drafter, the learning curves, the report
# --------------------------------------------------------------------------------------------------

def final_drafter(name: str, run: Path) -> Path:
    if name == "ours":
        from drafters.drafter.checkpoint import find_drafter_folder

        return find_drafter_folder(run)
    return sorted((run / "snapshots").glob("step-*"))[-1]


def decode(drafters: dict[str, Path], args, out: Path) -> dict:
    """Held-out tau of every drafter by one decoder; with --resume, a finished decode of the same drafters is reused
    (the figures are tau, which the machine's load does not change)."""
    eval_dir, threads = out / "eval", args.decode_threads or args.threads
    done = eval_dir / "report.json"
    if args.resume and done.exists() and [d["name"] for d in json.loads(done.read_text())["drafters"]] == list(drafters):
        print(f"[peers] decode: reusing {done}", flush=True)
        return {"taus": read_taus(json.loads(done.read_text()), list(drafters)), "seconds": None,
                "threads": None, "report": str(eval_dir / "report.md")}
    cmd = [sys.executable, "-m", "scripts.cli", "eval", "--config", args.config,
           *[f"--drafter={name}={path}" for name, path in drafters.items()], "--traces", args.traces,
           "--max-prompts", str(args.prompts), "--max-new-tokens", str(args.new_tokens),
           "--reference-subset", "0", "--threads", str(threads), "--out", str(eval_dir), *args.overrides]
    measured = run_measured(cmd, out / "eval.log", threads, timeout=6 * 3600)
    if measured["returncode"] != 0:
        raise RuntimeError(f"dflash-pipeline eval exited with {measured['returncode']}; see {out / 'eval.log'}")
    taus = read_taus(json.loads(done.read_text()), list(drafters))
    return {"taus": taus, "seconds": round(measured["wall_seconds"], 1), "threads": threads,
            "report": str(eval_dir / "report.md")}


def read_taus(report: dict, names: list[str]) -> dict:
    """{method: {category: {tau, identical, prompts}}} of the drafters and prompt lookup, from eval's report."""
    from eval.measures import LOOKUP

    taus = {}
    for category, c in report["categories"].items():
        for name in [*names, LOOKUP]:
            s = c["methods"].get(name)
            if s is not None:
                taus.setdefault(name, {})[category] = {"tau": s.get("tau_mean"), "identical": s.get("identical"),
                                                       "prompts": s.get("prompts")}
    return taus


def learning_curves(runs: dict[str, Path], target: str, args, out: Path) -> str:
    cmd = [sys.executable, "-m", "bench.bench_learning_curve", *[f"{name}={run}" for name, run in runs.items()],
           "--target", target,
           "--out", str(out / "curve"), "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens)]
    measured = run_measured(cmd, out / "curve.log", args.decode_threads or args.threads, timeout=6 * 3600)
    if measured["returncode"] != 0:
        raise RuntimeError(f"bench_learning_curve exited with {measured['returncode']}; see {out / 'curve.log'}")
    return str(out / "curve")


HOW = {"ours": "train/dflash.py (the config's recipe)",
       "specforge": "`specforge train`, unchanged (NO_SHARD, sdpa)",
       "speculators": "its model, loss, data, optimizer in a plain loop (its Trainer needs an accelerator)"}


def markdown(result: dict) -> str:
    from eval.measures import LOOKUP

    trained, taus, prep = result["trained"], result["decode"]["taus"], result["prepared"]
    categories = [c for c in result["categories"] if c != "all"]
    head = ["trainer", "how it ran", "steps", "s/step", "startup s", "train min", "peak RSS GiB",
            *[f"tau {c}" for c in categories], *[f"ours/peer {c}" for c in categories]]
    lines = [f"{result['budget_minutes']:g} minutes of training each on {result['threads']} threads; {prep['rows']} rows, "
             f"{prep['tokens']} tokens; drafter of {prep['num_layers']} layers, blocks of {prep['block_size']}, target "
             f"layers {prep['layer_ids']}; peers' anchors {result['peer_anchors']}. Held-out decoded tau (ours, "
             f"dflash-pipeline eval), {result['prompts']} prompts per category, {result['new_tokens']} new tokens.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ours = taus.get("ours", {})
    for name, t in trained.items():
        row = [name, HOW[name], str(t["steps"]), f"{t['step_seconds']:.2f}", f"{t['startup_seconds']:.0f}",
               f"{t['wall_seconds'] / 60:.1f}", f"{t['peak_rss_gib']:.2f}"]
        row += [_tau_cell(taus.get(name, {}).get(c)) for c in categories]
        row += ["" if name == "ours" else _ratio(ours.get(c), taus.get(name, {}).get(c)) for c in categories]
        lines.append("| " + " | ".join(row) + " |")
    if LOOKUP in taus:
        row = ["prompt lookup", "no training", "", "", "", "", "", *[_tau_cell(taus[LOOKUP].get(c)) for c in categories],
               *["" for _ in categories]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _tau_cell(entry) -> str:
    if not entry or entry.get("tau") is None:
        return ""
    exact = f" ({entry['identical']}/{entry['prompts']} exact)" if entry.get("identical") is not None else ""
    return f"{entry['tau']:.2f}{exact}"


def _ratio(ours, peer) -> str:
    if not ours or not peer or not ours.get("tau") or not peer.get("tau"):
        return ""
    return f"{ours['tau'] / peer['tau']:.2f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/testbed.yaml")
    parser.add_argument("--minutes", type=float, default=15.0, help="training wall-clock budget per trainer")
    parser.add_argument("--out", default="outputs/bench/peers")
    parser.add_argument("--peers", default="specforge,speculators")
    parser.add_argument("--specforge-python", default=PEER_PYTHON["specforge"])
    parser.add_argument("--speculators-python", default=PEER_PYTHON["speculators"])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--decode-threads", type=int, default=None,
                        help="threads of the decode and the curves (default --threads): tau does not depend on them, "
                             "so a shared machine can decode on fewer")
    parser.add_argument("--calibration-steps", default="ours=40,specforge=6,speculators=4",
                        help="steps of each trainer's calibration run")
    parser.add_argument("--peer-anchors", type=int, default=512,
                        help="anchors per sample (SpecForge) / per packed batch (speculators); both recipes use 512")
    parser.add_argument("--snapshots", type=int, default=5, help="snapshots per run, for the learning curves")
    parser.add_argument("--traces", default="code,chat,prose")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--curves", action="store_true", help="also score every snapshot (learning curves)")
    parser.add_argument("--resume", action="store_true", help="reuse the calibration and budget runs already in --out")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the config, as for train/dflash.py")
    args = parser.parse_args(argv)
    from configs.schema import ConfigError
    from train.batches import DatasetError

    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(TRAINERS[1:]))
    if unknown:
        print(f"error: unknown peer(s) {unknown}; known: {list(TRAINERS[1:])}", file=sys.stderr)
        raise SystemExit(2)
    for peer in peers:
        python = getattr(args, f"{peer}_python")
        if not Path(python).exists():
            print(f"error: --{peer}-python {python} does not exist; docs/peers.md says how to make its environment",
                  file=sys.stderr)
            raise SystemExit(2)
    calibration = {"ours": 40, "specforge": 6, "speculators": 4}
    try:
        calibration.update((k.strip(), int(v)) for k, v in (item.split("=") for item in args.calibration_steps.split(",")))
    except ValueError:
        print(f"error: --calibration-steps {args.calibration_steps!r} is not NAME=STEPS[,NAME=STEPS...]", file=sys.stderr)
        raise SystemExit(2) from None
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget = args.minutes * 60
    names = ["ours", *peers]

    try:
        prep = prepare(args.config, args.overrides, out, peers)
    except (ConfigError, DatasetError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"[peers] prepared {prep['rows']} rows, {prep['tokens']} tokens in {prep['prepare_seconds']} s; "
          f"exported in {prep['export_seconds']} s", flush=True)
    calibrated = {}
    for name in names:
        steps = calibration[name]
        calibrated[name] = train_one(name, prep, args, out, steps, max(1, steps // 4), "calibration",
                                     timeout=max(budget, 1800))
        c = calibrated[name]
        print(f"[peers] calibration {name}: startup {c['startup_seconds']:.0f} s, {c['step_seconds']:.2f} s/step, "
              f"peak {c['peak_rss_gib']:.2f} GiB", flush=True)
    trained = {}
    for name in names:
        steps = budget_steps(calibrated[name]["startup_seconds"], calibrated[name]["step_seconds"], budget)
        trained[name] = train_one(name, prep, args, out, steps, max(1, steps // args.snapshots), "budget",
                                  timeout=budget * 1.5 + 600)
        print(f"[peers] {name}: {steps} steps in {trained[name]['wall_seconds'] / 60:.1f} min, "
              f"peak {trained[name]['peak_rss_gib']:.2f} GiB", flush=True)
    runs = {name: Path(trained[name]["run"]) for name in names}
    decoded = decode({name: final_drafter(name, run) for name, run in runs.items()}, args, out)
    result = {"budget_minutes": args.minutes, "threads": args.threads, "peer_anchors": args.peer_anchors,
              "config": args.config, "overrides": args.overrides, "prepared": prep, "calibration": calibrated,
              "trained": trained, "decode": decoded, "categories": args.traces.split(","), "prompts": args.prompts,
              "new_tokens": args.new_tokens}
    if args.curves:
        result["curves"] = learning_curves(runs, prep["target"], args, out)
    (out / "peers.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "peers.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
