"""The loop, end to end, as one command: serve, log, retrain, promote, serve again (dflash-pipeline loop).

    dflash-pipeline loop --out outputs/closed-loop [--config configs/closed-loop-testbed.yaml] [key=value ...]

1. **v0**: `train/dflash.py` trains a stage-1 drafter (`--v0-config`, capped by `train.max_steps`);
   `dflash-pipeline retrain --bootstrap` installs it as v0000, and its `retrain.on_promote` hook
   (`dflash-pipeline serve restart --drafter {bf16}`) starts the vLLM server with it.
2. **Traffic**: the log tap (`dflash-pipeline tap`) in front of the server, with the agent simulator's training
   sessions as its clients (`simulator/remote.py`). Held-out sessions (the simulator's held-out split: other stdlib
   files) go straight to the server; the engine's own counters (`/metrics`) over exactly them give v0's tau.
3. **Retrain**: the tap is stopped (SIGTERM: every answered request is in a closed segment), then one cycle of
   `dflash-pipeline retrain` on the tap's logs: with `target.backend: vllm` its gate measures both drafters in the engine
   and runs the serving check there (retraining/gate.py).
4. **Promote**: a promotion runs the same hook, which restarts the server with v1.
5. **Held out again**: the same held-out requests through the server again, round by round as the sessions sent
   them: v1's tau from the counters, on exactly the prompts v0 was counted on.

Everything goes under `--out`: the resolved config (`loop-config.yaml`, what every step reads), `v0/`, `serve/`
(server.json, server.log, serve.jsonl), `tap-logs/`, `state/` (the retraining state dir), `sim/` (the simulator's
own copies of the sessions) and `report.json`. The server and the tap are stopped when the command ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.atomic_files import write_json_atomic, write_text_atomic
from common.commands import cli_command
from configs.schema import PipelineConfig, dump_config, load_config, with_values
from drafters.drafter.checkpoint import find_drafter_folder
from drafters.target.chat import load_tokenizer
from engines.hf.generation import stop_token_ids
from engines.vllm import server as serve
from engines.vllm.engine import ServerEngine
from engines.vllm.server import engine_flags, healthy, make_spec
from retraining.state import StateDir, read_jsonl
from simulator.remote import ServerGenerator
from simulator.simulate import SimConfig, simulate
from train.setup import resolve_target

REPO = Path(__file__).resolve().parents[1]
# v0 on the testbed within the loop's 30 minutes: a third of the quickstart's mixture, 300 steps.
V0_OVERRIDES = ["data.mixture.num_samples=160", "data.mixture.prefilled_samples=100", "train.max_steps=300",
                "train.snapshot_every=null", "logging.wandb=false"]


class LoopError(RuntimeError):
    """A step of the loop failed (the message names the step and where its log is)."""


@dataclass
class LoopSettings:
    out: Path
    config: str = "configs/closed-loop-testbed.yaml"
    overrides: list[str] = field(default_factory=list)
    v0_config: str = "configs/testbed.yaml"
    v0_overrides: list[str] = field(default_factory=lambda: list(V0_OVERRIDES))
    train_sessions: int = 24
    heldout_sessions: int = 5
    train_seed: int = 1
    heldout_seed: int = 1
    turns: str = "4-6"
    subagent_share: float = 0.0  # the tap logs no cross-session parent link (see scripts/RETRAIN.md)
    max_new_tokens: int = 128    # turns long enough to repeat earlier text, which is what a fine-tune teaches
    tool_tokens: int = 192
    context_cap: int = 1536
    concurrency: int = 24        # the simulator's batch: requests in flight at once (the server batches them)
    server_port: int = 0         # 0: a free port
    tap_port: int = 0
    start_timeout: float = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # The steps run beside the server, the tap and whatever else shares the cores: OpenMP threads that spin while
    # they wait lose most of their time slices when there are more threads than free cores (a training step 13x
    # slower beside one busy process on 2 cores, measured); passive waiting degrades gracefully instead.
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "WANDB_SILENT": "true"}


def _run_step(name: str, argv: list[str], log_file: Path, log, ran: list | None = None) -> None:
    """A step as its own process (as a user or a scheduler runs it), its output in log_file; its argv is added
    to `ran` (the report's commands)."""
    log(f"[loop] {name}: {' '.join(argv)} (log {log_file})")
    if ran is not None:
        ran.append(list(argv))
    with open(log_file, "a", encoding="utf-8") as out:
        code = subprocess.run(argv, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = log_file.read_text(errors="replace")[-3000:]
        raise LoopError(f"{name} exited with {code} ({log_file}):\n{tail}")


def loop_config(settings: LoopSettings) -> PipelineConfig:
    config = load_config(settings.config, settings.overrides)
    if config.target.backend != "vllm":
        raise LoopError(f"{settings.config}: target.backend is {config.target.backend!r}; the loop serves through "
                        "vLLM (target.backend: vllm)")
    if "bf16" not in config.retrain.export_dtypes:
        raise LoopError(f"{settings.config}: retrain.export_dtypes must include bf16 (the server serves that export)")
    return config


def with_loop_paths(config: PipelineConfig, out: Path, v0: Path, hook: list[str]) -> PipelineConfig:
    """The loop's config with its paths filled in: what every later step reads (OUT/loop-config.yaml)."""
    return with_values(config, {
        "retrain.trajectories": [str(out / "tap-logs")], "retrain.state_dir": str(out / "state"),
        "retrain.initial_drafter": str(v0), "retrain.on_promote": hook}, source="closed loop")


def train_v0(settings: LoopSettings, config: PipelineConfig, log) -> Path:
    """Stage 1 by train/dflash.py (reused when the loop runs again in the same --out); its final drafter folder."""
    out = settings.out / "v0"
    marker = settings.out / "v0-done.json"
    if marker.exists():
        done = json.loads(marker.read_text())
        log(f"[loop] v0 already trained: {done['drafter']}")
        return Path(done["drafter"])
    same_target = [f"target.path={config.target.path}"] if config.target.path else []
    cache = [f"cache_dir={config.cache_dir}"] if config.cache_dir else []
    argv = [sys.executable, "train/dflash.py", "--config", settings.v0_config, f"output_dir={out}", *same_target,
            *cache, *settings.v0_overrides]
    _run_step("v0 training", argv, settings.out / "v0-train.log", log)
    drafter = find_drafter_folder(out)
    write_json_atomic(marker, {"drafter": str(drafter), "argv": argv})
    return drafter


def counters(url: str) -> tuple[int, int]:
    return ServerEngine(url, model="-").counters()


def start_tap(settings: LoopSettings, upstream: str, log, ran: list | None = None) -> tuple[subprocess.Popen, str]:
    port = settings.tap_port or free_port()
    url = f"http://127.0.0.1:{port}"
    log_file = open(settings.out / "tap.log", "a", encoding="utf-8")
    argv = cli_command("tap") + ["--upstream", upstream, "--out", str(settings.out / "tap-logs"),
            "--port", str(port)]
    if ran is not None:
        ran.append(argv)
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=log_file, stderr=subprocess.STDOUT)
    log_file.close()
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise LoopError(f"the log tap exited with {proc.returncode} ({settings.out / 'tap.log'})")
        if healthy(url, timeout=2.0, path="/tap/health"):
            log(f"[loop] log tap at {url} -> {upstream}, logs under {settings.out / 'tap-logs'}")
            return proc, url
        time.sleep(0.5)
    proc.kill()
    raise LoopError(f"the log tap did not come up in 120 s ({settings.out / 'tap.log'})")


def stop_tap(proc: subprocess.Popen, url: str) -> dict:
    """SIGTERM (graceful: what systemd sends); its counters first."""
    with urllib.request.urlopen(f"{url}/tap/health", timeout=10) as response:
        health = json.loads(response.read())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    return {"answered": health["answered"], "records": health["records"], "quarantined": health["quarantined"],
            "exit": proc.returncode}


def sessions(settings: LoopSettings, split: str, seed: int, count: int, url: str, target: Path, out: Path,
             name: str) -> tuple[dict, list]:
    """Simulated sessions as clients of `url`: what they sent and got, the wall time, and the records."""
    config = SimConfig(sessions=count, split=split, seed=seed, turns=settings.turns,
                       subagent_share=settings.subagent_share, max_new_tokens=settings.max_new_tokens,
                       tool_tokens=settings.tool_tokens, context_cap=settings.context_cap,
                       batch_size=settings.concurrency, name=name)
    started = time.perf_counter()
    result = simulate(config, out, target, server_url=url, progress=False)
    wall = time.perf_counter() - started
    summary = result.summary
    return ({"log": str(result.path), "sessions": summary["sessions"], "requests": summary["requests"],
             "input_tokens": summary["input_tokens"], "output_tokens": summary["output_tokens"],
             "wall_seconds": round(wall, 2), "output_tokens_per_s": round(summary["output_tokens"] / wall, 2)},
            result.records)


def _with_tau(run: dict, before: tuple[int, int], after: tuple[int, int]) -> dict:
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    return {**run, "drafts": drafts, "accepted": accepted, "tau": 1.0 + accepted / drafts if drafts else None}


def heldout_live(settings: LoopSettings, server_url: str, target: Path, log) -> tuple[dict, list]:
    """v0: the held-out sessions straight to the server; tau from the engine's counters over exactly those requests."""
    before = counters(server_url)
    run, records = sessions(settings, "heldout", settings.heldout_seed, settings.heldout_sessions, server_url, target,
                            settings.out / "sim" / "heldout", "heldout")
    run = _with_tau({"mode": "live sessions", **run}, before, counters(server_url))
    log(f"[loop] held-out sessions through the server with v0: {run['requests']} requests, {run['output_tokens']} "
        f"tokens, engine tau {run['tau']} ({run['accepted']} draft tokens accepted in {run['drafts']} drafts)")
    return run, records


def heldout_replay(settings: LoopSettings, server_url: str, target: Path, records: list, log) -> dict:
    """v1: the same held-out requests again, round by round as the sessions sent them (the k-th request of every
    session together), so that both drafters are counted on identical prompts; a live rerun would diverge wherever
    the bf16 server's batched greedy output flips a near-tie (measured: the same v0 gave 1.199 and 1.235)."""
    generate = ServerGenerator(server_url, stop_token_ids(target, load_tokenizer(target)), 0.0, 0)
    by_session: dict[str, list] = {}
    for record in sorted(records, key=lambda r: (r.timestamp, r.request_id)):
        by_session.setdefault(record.session_id, []).append(record)
    rounds = max(len(rs) for rs in by_session.values())
    before, started, identical, tokens = counters(server_url), time.perf_counter(), 0, 0
    for k in range(rounds):
        batch = [rs[k] for rs in by_session.values() if k < len(rs)]
        for start in range(0, len(batch), settings.concurrency):
            part = batch[start:start + settings.concurrency]
            outs = generate([r.input_ids.tolist() for r in part], [int(r.metadata["max_new_tokens"]) for r in part],
                            [r.request_id for r in part])
            identical += sum(out == r.output_ids.tolist() for (out, _), r in zip(outs, part))
            tokens += sum(len(out) for out, _ in outs)
    wall = time.perf_counter() - started
    run = _with_tau({"mode": "the same requests replayed", "requests": len(records), "output_tokens": tokens,
                     "outputs_identical_to_v0_run": identical, "wall_seconds": round(wall, 2)},
                    before, counters(server_url))
    log(f"[loop] the same held-out requests through the server with v1: {run['requests']} requests ({identical} "
        f"outputs identical to v0's), engine tau {run['tau']} ({run['accepted']} draft tokens accepted in "
        f"{run['drafts']} drafts)")
    return run


def run_loop(settings: LoopSettings, log=print) -> dict:
    started = time.time()
    out = settings.out = Path(settings.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim").mkdir(exist_ok=True)
    serve_dir = out / "serve"
    hook = cli_command("serve", "restart") + ["--state-dir", str(serve_dir),
            "--drafter", "{bf16}", "--timeout", str(settings.start_timeout)]
    config = loop_config(settings)
    config_path = out / "loop-config.yaml"
    target = resolve_target(config, log)
    steps: dict[str, float] = {}
    report: dict = {"settings": {**asdict(settings), "out": str(out)}, "config": str(config_path),
                    "target": str(target), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": steps,
                    "commands": []}
    ran = report["commands"]  # every step's process, as a user would type it

    def step(name: str, t0: float) -> None:
        steps[name] = round(time.time() - t0, 1)

    tap = None
    try:
        t0 = time.time()
        v0 = train_v0(settings, config, log)
        config = with_loop_paths(config, out, v0, hook)
        write_text_atomic(config_path, dump_config(config))
        report["v0"] = {"drafter": str(v0), "train_log": str(out / "v0-train.log")}
        step("1_train_v0", t0)

        t0 = time.time()
        port = settings.server_port or free_port()
        serve.write_spec(serve_dir, make_spec(target, engine_flags(config.target, target, config.train.seed), port))
        retrain = cli_command("retrain") + ["--config", str(config_path)]
        _run_step("bootstrap v0000 (its hook starts the server)", [*retrain, "--bootstrap"], out / "retrain.log", log,
                  ran)
        server_url = serve.url_of(serve.read_spec(serve_dir))
        report["server"] = {"url": server_url, "state_dir": str(serve_dir), "log": str(serve_dir / "server.log")}
        step("1_bootstrap_and_serve_v0", t0)

        t0 = time.time()
        tap, tap_url = start_tap(settings, server_url, log, ran)
        traffic, _ = sessions(settings, "train", settings.train_seed, settings.train_sessions, tap_url, target,
                              out / "sim" / "train", "train")
        log(f"[loop] traffic: {traffic['requests']} requests of {traffic['sessions']} sessions through the tap")
        step("2_traffic_through_the_tap", t0)

        t0 = time.time()
        heldout_v0, heldout_records = heldout_live(settings, server_url, target, log)
        report["heldout"] = {"v0": heldout_v0}
        step("2_heldout_v0", t0)

        t0 = time.time()
        report["tap"] = stop_tap(tap, tap_url)
        tap = None
        report["traffic"] = traffic
        _run_step("retraining cycle", retrain, out / "retrain.log", log, ran)
        cycles = [r for r in read_jsonl(StateDir(config.retrain.state_dir).history) if r.get("event") == "cycle"]
        cycle = cycles[-1]
        report["cycle"] = {k: cycle.get(k) for k in ("cycle", "status", "reason", "current_version",
                                                       "promoted_version", "tau_current", "tau_candidate", "split",
                                                       "requests", "tokens", "train", "eval", "gate",
                                                       "serving_check", "seconds")}
        step("3_retrain_and_4_promote", t0)

        served = serve.read_spec(serve_dir)
        report["server"]["drafter_now"] = served.get("drafter")
        report["server"]["events"] = read_jsonl(serve_dir / serve.EVENTS_FILE)
        if cycle["status"] == "promoted":
            t0 = time.time()
            report["heldout"]["v1"] = heldout_replay(settings, server_url, target, heldout_records, log)
            step("5_heldout_v1", t0)
    finally:
        if tap is not None:
            tap.kill()
            tap.wait()
        if (serve_dir / serve.SPEC_FILE).exists():
            serve.stop(serve_dir, log=log)

    margin = config.retrain.promotion_margin
    tau_v0 = report["heldout"]["v0"]["tau"]
    tau_v1 = report["heldout"].get("v1", {}).get("tau")
    report.update({
        "tau_v0": tau_v0, "tau_v1": tau_v1, "promotion_margin": margin,
        "gain": tau_v1 / tau_v0 - 1.0 if tau_v0 and tau_v1 else None,
        "v1_beats_v0_by_margin": bool(tau_v0 and tau_v1 and tau_v1 > tau_v0 * (1.0 + margin)),
        "wall_seconds": round(time.time() - started, 1), "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    write_json_atomic(out / "report.json", report)
    log(f"[loop] {'promoted' if tau_v1 else cycle['status']}: held-out engine tau v0 {tau_v0} -> v1 {tau_v1} "
        f"(margin {margin:.0%}); {report['wall_seconds']} s; report {out / 'report.json'}")
    return report
