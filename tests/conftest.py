import json
import pickle
import random

import pytest


class _Exploit:
    """Unpickling it creates a file: what a crafted checkpoint could do with a shell command instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# The suite runs on two pytest-xdist workers (pyproject's addopts, --dist loadfile): each module whole on one
# worker, so that its module fixtures (trained drafters, servers) are built once. The modules that start vLLM
# engines are the longest; they are collected first so that the two workers end together.
ENGINE_MODULES = ("test_engine_capture", "test_engine_server", "test_engine_serving", "test_closed_loop",
                  "test_production_guide", "test_log_tap")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.module.__name__.rsplit(".", 1)[-1] not in ENGINE_MODULES)  # stable


@pytest.fixture(scope="session")
def crafted_pickle():
    """crafted_pickle(marker) -> pickle bytes that create `marker` when unpickled."""
    return lambda marker: pickle.dumps(_Exploit(marker))


@pytest.fixture(scope="session")
def testbed_target():
    """The converted SmolLM2-135M-Instruct folder (converted once per machine, then reused)."""
    from drafters.target.testbed import prepare_testbed_target

    return prepare_testbed_target()


@pytest.fixture(scope="session")
def chat_engine_target(testbed_target, tmp_path_factory):
    """A tiny chat target vLLM's CPU build serves (eval/engine_testbed.py), with SmolLM2's tokenizer."""
    from eval.engine_testbed import save_chat_engine_target

    return save_chat_engine_target(tmp_path_factory.mktemp("chat-engine") / "target", testbed_target)


# The closed loop's CI variant (dflash-pipeline loop on chat_engine_target): v0 trains 2 steps, the cycle 12.
CLOSED_LOOP_V0 = ["data.mixture.num_samples=6", "data.mixture.max_new_tokens=16", "data.mixture.prefilled_samples=0",
                  "data.max_seq_len=256", "train.max_steps=2", "train.snapshot_every=null", "logging.wandb=false",
                  "drafter.num_layers=1", "drafter.num_key_value_heads=null", "drafter.num_target_features=3",
                  "train.copy_heads=0", "train.copy_value_weight=null"]


@pytest.fixture(scope="session")
def closed_loop_run(chat_engine_target, tmp_path_factory):
    """One run of the loop command, shared by tests/test_closed_loop.py and the production guide's test:
    (its output folder, the completed process)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("closed-loop") / "loop"
    argv = [sys.executable, "-m", "scripts.cli", "loop", "--out", str(out),
            *(x for o in CLOSED_LOOP_V0 for x in ("--v0-set", o)),
            "--train-sessions", "3", "--heldout-sessions", "1", "--train-seed", "0", "--turns", "2",
            "--max-new-tokens", "16", "--tool-tokens", "32", "--context-cap", "1024",
            f"target.path={chat_engine_target}", "target.memory_share=0.05", "train.max_steps=12", "train.lr=3e-3",
            "retrain.heldout_fraction=0.34", "retrain.eval.max_prompts=2", "retrain.eval.agentic_per_session=2",
            "retrain.eval.max_new_tokens=24"]
    result = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return out, result


def hostile_lines(n: int, seed: int, max_record_bytes: int) -> list[bytes]:
    """n JSONL lines that must each be quarantined, never stop a reader: one of every kind first, then random
    ones (huge integer literals, deep nesting, oversized records, truncated or random bytes, lone surrogates,
    wrong types), each in random positions of an otherwise valid record."""
    rng = random.Random(seed)

    def record(k: int, **fields) -> dict:
        return {"session_id": f"hostile-{k}", "request_id": f"hostile-{k}", "input_ids": [1, 2, 3],
                "output_ids": [4, 5], "timestamp": 1_700_000_000.0, **fields}

    def spliced(k: int, field: str, raw: bytes) -> bytes:
        marker = "@@RAW@@"
        return json.dumps(record(k, **{field: marker})).encode().replace(f'"{marker}"'.encode(), raw)

    def huge_int(k):
        digits = b"9" * rng.randint(4301, 20000)
        return spliced(k, rng.choice(["input_ids", "output_ids", "timestamp", "metadata"]),
                       b"[" + digits + b"]" if rng.random() < 0.5 else digits)

    def deep(k):
        depth = rng.randint(1100, 6000)  # past the parser's recursion limit, under the test's byte limit
        nest = b"[" * depth + b"]" * depth if rng.random() < 0.5 else b'{"a":' * depth + b"1" + b"}" * depth
        return nest if rng.random() < 0.3 else spliced(k, rng.choice(["input_ids", "metadata", "session_id"]), nest)

    def deep_metadata(k):  # parses, but nested past what a record may carry
        depth = rng.randint(40, 800)
        return spliced(k, "metadata", b'{"a":' * depth + b"1" + b"}" * depth)

    def oversized(k):
        return spliced(k, "input_ids", b"[" + b"7," * (max_record_bytes // 2 + rng.randint(1, 1000)) + b"7]")

    def truncated(k):
        line = json.dumps(record(k)).encode()
        return line[: rng.randint(1, len(line) - 1)]

    def random_bytes(k):
        return bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(rng.randint(8, 300)))

    def surrogate(k):
        return spliced(k, rng.choice(["session_id", "request_id", "parent_request_id"]), b'"x\\ud800y"')

    def wrong_value(k):
        field = rng.choice(["input_ids", "output_ids", "timestamp", "session_id"])
        return spliced(k, field, rng.choice([b"1e999", b"NaN", b"-Infinity", b"[1.5]", b"[true]", b"[-1]",
                                             b"[1e400]", b'""', b"null", b"[[1]]", b"{}", b"[]"]))

    kinds = [huge_int, deep, deep_metadata, oversized, truncated, random_bytes, surrogate, wrong_value]
    return [(kinds[k] if k < len(kinds) else rng.choice(kinds))(k) for k in range(n)]


@pytest.fixture(scope="session")
def make_hostile_lines():
    return hostile_lines


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, proc, timeout: float = 60.0) -> None:
    import time
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


@pytest.fixture
def start_tap(tmp_path):
    """start_tap(upstream, out, *flags) -> (url, process): `dflash-pipeline tap` on a free port, up and healthy.
    Every tap still running at the test's end gets SIGTERM."""
    import subprocess
    import sys
    from pathlib import Path

    started = []

    def start(upstream: str, out, *flags: str):
        port = _free_port()
        log = open(tmp_path / f"tap-{port}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "scripts.cli", "tap", "--upstream", upstream, "--out", str(out),
                                 "--port", str(port), *flags], cwd=Path(__file__).resolve().parents[1],
                                stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/tap/health", proc)
        return url, proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
