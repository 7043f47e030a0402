"""A vLLM OpenAI server for a target and a DFlash drafter, managed through a state folder (the testbed's serving side).

    dflash-pipeline serve start --config CONFIG --state-dir DIR --port 8000 --drafter DRAFTER
    dflash-pipeline serve restart --state-dir DIR --drafter NEW_DRAFTER   # what retrain.on_promote runs
    dflash-pipeline serve status --state-dir DIR
    dflash-pipeline serve stop --state-dir DIR

The state folder holds `server.json` (how the server is launched: target, drafter, port, the engine flags from
the config's engine block, and the pid of the running server), `server.log` (the server's output, appended
across restarts) and `serve.jsonl` (one line per start and stop). `restart` relaunches from `server.json` with
the new drafter, and waits until `/health` answers, so that when it returns the engine serves what `current`
names. The server runs in its own session, so it outlives the command that started it; `stop` signals that
session only after checking that the pid is still the server it launched (same command line, same port).

On GPUs the same hook does a rolling restart of the replicas (one at a time behind the load balancer), or,
with SGLang, `/update_weights_from_disk` where the installed version can reload the draft model
(scripts/RETRAIN.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.atomic_files import write_json_atomic
from configs.schema import TargetConfig
from engines.settings import vllm_kwargs
from engines.vllm.engine import EngineError, ServerEngine, speculative_config

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SPEC_FILE = "server.json"
LOG_FILE = "server.log"
EVENTS_FILE = "serve.jsonl"
DEFAULT_CONTEXT = 4096


class ServeError(RuntimeError):
    """The server could not be started, found or stopped (the message names the state folder and the cause)."""


def _paths(state_dir: str | Path) -> tuple[Path, Path, Path]:
    root = Path(state_dir)
    return root / SPEC_FILE, root / LOG_FILE, root / EVENTS_FILE


def read_spec(state_dir: str | Path) -> dict:
    spec_path = _paths(state_dir)[0]
    if not spec_path.is_file():
        raise ServeError(f"{state_dir}: no {SPEC_FILE}; start a server there first "
                         "(serve.py start --config ...)")
    try:
        return json.loads(spec_path.read_text())
    except json.JSONDecodeError as err:
        raise ServeError(f"{spec_path} is not valid JSON ({err})") from None


def engine_flags(target: TargetConfig, target_path: str | Path, seed: int = 0) -> list[str]:
    """The server's engine flags from the engine block (`target:`; engines/settings.py), as the in-process engines
    read them: dtype, context length, memory share, parallelism, quantization, remote code."""
    kwargs = vllm_kwargs(target, target_path, max_model_len=target.max_model_len or DEFAULT_CONTEXT, seed=seed)
    flags = ["--dtype", kwargs["dtype"], "--max-model-len", str(kwargs["max_model_len"]),
             "--gpu-memory-utilization", str(kwargs["gpu_memory_utilization"]),
             "--tensor-parallel-size", str(kwargs["tensor_parallel_size"]),
             "--pipeline-parallel-size", str(kwargs["pipeline_parallel_size"]), "--seed", str(kwargs["seed"])]
    if kwargs.get("enable_expert_parallel"):
        flags.append("--enable-expert-parallel")
    if kwargs.get("quantization"):
        flags += ["--quantization", kwargs["quantization"]]
    if kwargs.get("trust_remote_code"):
        flags.append("--trust-remote-code")
    if kwargs.get("enforce_eager"):
        flags.append("--enforce-eager")
    return flags


def make_spec(target: str | Path, flags: list[str], port: int, host: str = "127.0.0.1",
              drafter: str | Path | None = None, served_model_name: str | None = None) -> dict:
    target = Path(target).resolve()
    if not (target / "config.json").is_file():
        raise ServeError(f"target {target} is not a model folder (no config.json)")
    return {"target": str(target), "drafter": str(Path(drafter).resolve()) if drafter else None, "port": int(port),
            "host": host, "flags": list(flags), "served_model_name": served_model_name or target.name, "pid": None}


def write_spec(state_dir: str | Path, spec: dict) -> None:
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(_paths(state_dir)[0], spec)


def url_of(spec: dict) -> str:
    return f"http://{spec['host']}:{spec['port']}"


def command(spec: dict) -> list[str]:
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", spec["target"], "--host", spec["host"],
            "--port", str(spec["port"]), "--served-model-name", spec["served_model_name"], *spec["flags"]]
    target = Path(spec["target"])
    if not any((target / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        argv.append("--skip-tokenizer-init")  # ids in, ids out: a target without a tokenizer
    if spec.get("drafter"):
        argv += ["--speculative-config", json.dumps(speculative_config(spec["drafter"]))]
    return argv


def _event(state_dir: str | Path, **fields) -> None:
    with open(_paths(state_dir)[2], "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **fields}) + "\n")


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reaps it when this process started it
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _session_members(sid: int) -> list[int]:
    """Live processes of the session the server leads (the API server, its engine core and workers)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                members.append(int(entry.name))
    return members


def _is_our_server(pid: int, spec: dict) -> bool:
    """The pid still runs the server this folder launched (not a reused pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    args = [a.decode(errors="replace") for a in argv]
    return SERVER_MODULE in args and "--port" in args and args[args.index("--port") + 1] == str(spec["port"])


def running_pid(spec: dict) -> int | None:
    pid = spec.get("pid")
    return pid if pid and _alive(pid) and _is_our_server(pid, spec) else None


def healthy(url: str, timeout: float = 5.0, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def _log_tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


def start(state_dir: str | Path, spec: dict | None = None, *, timeout: float = 900.0, log=print) -> dict:
    """Launch the server described by `spec` (or the folder's server.json) and wait for /health; returns the spec
    with its pid. Refuses when the folder's server is still running."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    spec_path, log_path, _ = _paths(state_dir)
    if spec_path.exists():
        old = read_spec(state_dir)
        if running_pid(old):
            raise ServeError(f"{state_dir}: the server (pid {old['pid']}, {url_of(old)}) is still running; stop or "
                             "restart it")
    spec = dict(spec or read_spec(state_dir))
    if spec.get("drafter") and not (Path(spec["drafter"]) / "config.json").is_file():
        raise ServeError(f"drafter {spec['drafter']} is not a drafter folder (no config.json)")
    url = url_of(spec)
    if healthy(url, timeout=2.0):
        raise ServeError(f"{url} already answers /health: another server holds port {spec['port']}")
    argv = command(spec)
    started = time.time()
    with open(log_path, "a", encoding="utf-8") as out:
        out.write(f"\n===== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    spec["pid"] = proc.pid
    write_spec(state_dir, spec)
    log(f"[serve] starting vLLM at {url}: target {spec['target']}, drafter {spec.get('drafter')} (pid {proc.pid}, "
        f"log {log_path})")
    deadline = started + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            spec["pid"] = None
            write_spec(state_dir, spec)
            _event(state_dir, event="start_failed", drafter=spec.get("drafter"), exit=proc.returncode)
            raise ServeError(f"the vLLM server exited with {proc.returncode} before it was healthy "
                             f"({log_path}):\n{_log_tail(log_path)}")
        if healthy(url):
            ready = round(time.time() - started, 1)
            _event(state_dir, event="started", pid=proc.pid, drafter=spec.get("drafter"), url=url, ready_seconds=ready)
            log(f"[serve] {url} is healthy after {ready} s")
            return spec
        time.sleep(1.0)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    spec["pid"] = None
    write_spec(state_dir, spec)
    _event(state_dir, event="start_failed", drafter=spec.get("drafter"), reason="timeout")
    raise ServeError(f"the vLLM server did not answer {url}/health within {timeout:.0f} s ({log_path}):\n"
                     f"{_log_tail(log_path)}")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the server leads its own session: its engine processes go with it
    except ProcessLookupError:
        pass


def stop(state_dir: str | Path, *, timeout: float = 60.0, log=print) -> bool:
    """SIGTERM the folder's server (its whole session), SIGKILL after `timeout`; True when one was running."""
    spec = read_spec(state_dir)
    pid = running_pid(spec)
    if pid is None:
        if spec.get("pid"):
            spec["pid"] = None
            write_spec(state_dir, spec)
        return False
    _signal_group(pid, signal.SIGTERM)
    # The engine processes outlive the API server for a moment: their memory and the port must be free before a
    # restart starts the next engine.
    deadline = time.time() + timeout
    while time.time() < deadline and (_alive(pid) or _session_members(pid)):
        time.sleep(0.5)
    killed = _alive(pid) or bool(_session_members(pid))
    if killed:
        _signal_group(pid, signal.SIGKILL)
        while _alive(pid) or _session_members(pid):
            time.sleep(0.2)
    spec["pid"] = None
    write_spec(state_dir, spec)
    _event(state_dir, event="stopped", pid=pid, drafter=spec.get("drafter"), killed=killed)
    log(f"[serve] stopped the server at {url_of(spec)} (pid {pid}{', SIGKILL' if killed else ''})")
    return True


def restart(state_dir: str | Path, drafter: str | Path | None = None, *, timeout: float = 900.0, log=print) -> dict:
    """Stop the folder's server (if running) and start it again, with `drafter` when given (an empty string:
    the target alone)."""
    spec = read_spec(state_dir)
    stop(state_dir, log=log)
    spec = read_spec(state_dir)
    if drafter is not None:
        spec["drafter"] = str(Path(drafter).resolve()) if str(drafter) else None
    return start(state_dir, spec, timeout=timeout, log=log)


def status(state_dir: str | Path) -> dict:
    spec = read_spec(state_dir)
    pid = running_pid(spec)
    url = url_of(spec)
    out = {"url": url, "pid": pid, "running": pid is not None, "healthy": healthy(url) if pid else False,
           "target": spec["target"], "drafter": spec.get("drafter"), "log": str(_paths(state_dir)[1])}
    if out["healthy"]:
        try:
            out["drafts"], out["accepted"] = ServerEngine(url, model=spec["served_model_name"]).counters()
        except EngineError as err:
            out["metrics_error"] = str(err)
    return out
