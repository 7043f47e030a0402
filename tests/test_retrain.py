"""scripts/retrain.py: the continuous-retraining cycle, end to end in real processes (no mocks).

Target: a tiny random-weight Llama (hidden 64, 8 layers) carrying the SmolLM2 tokenizer and chat template
(same 49,152-token vocabulary), so that the agentic simulator (dflash-pipeline simulate) can make the
traffic: the tiny target writes every assistant turn, tool results are real. Its greedy outputs are
extremely low-entropy (one token repeated, chosen by the context), which a 1-layer drafter learns in 10
steps: that is what makes two promotions observable on a shared 2-core CPU in a few seconds. The real
SmolLM2 target learns far too slowly for that (scripts/RETRAIN.md, "Testbed numbers").

Traffic drift between the cycles is real simulator traffic too: cycle 2's agent harness prefills every
assistant turn with "Tool call:" (a changed chat template), so the target's outputs change and the drafter
promoted in cycle 1 no longer predicts them.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from data.trajectory.reader import load_trajectories, write_trajectories
from retraining.state import StateDir, new_state
from retraining.traffic import cycle_heldout_file, discover, is_heldout, session_roots

REPO = Path(__file__).resolve().parents[1]
RETRAIN = REPO / "scripts" / "retrain.py"
CONFIG = REPO / "configs" / "retrain-testbed.yaml"
VOCAB = 49_152
SYSTEM = "You are a coding agent. Tools: read_file, list_dir, grep, run, task."
GENERATION_PROMPT = "'<|im_start|>assistant\n' }}"
PREFILL = "Tool call:"
# Session ids of the simulator are a function of (split, seed, index): with 3 sessions per run these seeds
# put exactly one root session of three on the held-out side at heldout_fraction 0.34 (asserted below).
SEEDS = {"cycle1": 0, "cycle2": 3, "cycle3": 6}
MAX_RECORD_BYTES = 1 << 16
HOSTILE = 16  # hostile lines mixed into cycle 1's traffic


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
            "WANDB_SILENT": "true"}


def overrides(target: Path, state: Path, incoming: list[Path], *extra: str) -> list[str]:
    return [f"target.path={target}", f"retrain.state_dir={state}",
            "retrain.trajectories=[" + ", ".join(str(p) for p in incoming) + "]",
            "logging.wandb=false", "retrain.heldout_fraction=0.34", "retrain.eval.max_prompts=2",
            "retrain.eval.agentic_per_session=2", "retrain.eval.max_new_tokens=32",
            "train.max_steps=10", "train.save_every=5", f"data.max_record_bytes={MAX_RECORD_BYTES}", *extra]


def retrain(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RETRAIN), "--config", str(CONFIG), *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    return result.stdout


def state_of(root: Path) -> dict:
    return json.loads((root / "state.json").read_text())


def history_of(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines() if line.strip()]


def copy_state(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# --------------------------------------------------------------------------------------------------
# Target and traffic
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from drafters.target.testbed import prepare_testbed_target, save_tiny_target

    smol = prepare_testbed_target()
    folder = save_tiny_target("llama", tmp_path_factory.mktemp("retrain") / "target")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smol / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def traffic(target, tmp_path_factory):
    """seed, prefill -> a simulated log file (production format), generated once per module."""
    import torch
    from transformers import AutoModelForCausalLM

    from drafters.target.chat import load_tokenizer
    from simulator.simulate import SimConfig, simulate

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    made: dict = {}
    root = tmp_path_factory.mktemp("traffic")

    def make(seed: int, prefill: str = "") -> Path:
        if (seed, prefill) not in made:
            tok = load_tokenizer(target)
            if prefill:  # the agent harness prefills every assistant turn
                assert GENERATION_PROMPT in tok.chat_template
                tok.chat_template = tok.chat_template.replace(GENERATION_PROMPT,
                                                              GENERATION_PROMPT[:-5] + prefill + "' }}")
            config = SimConfig(sessions=3, split="train", seed=seed, turns=3, subagent_share=0.5, subagents=1,
                               sub_turns=2, max_new_tokens=32, summary_tokens=8, tool_tokens=32, context_cap=1024,
                               batch_size=8, dtype="fp32", system_prompt=SYSTEM,
                               name=f"traffic-seed{seed}" + ("-prefilled" if prefill else ""))
            made[(seed, prefill)] = simulate(config, root / f"{seed}-{bool(prefill)}", target, model=model,
                                             tokenizer=tok, num_threads=1, progress=False).path
        return made[(seed, prefill)]

    return make


def with_hostile_lines(log: Path, dst: Path, hostile: list[bytes]) -> Path:
    """The log's lines with hostile ones inserted at random places, as one gzip file."""
    mixed = gzip.decompress(log.read_bytes()).splitlines()
    rng = random.Random(0)
    for line in hostile:
        mixed.insert(rng.randint(0, len(mixed)), line)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(gzip.compress(b"\n".join(mixed) + b"\n"))
    return dst


def ship(log: Path, incoming: Path) -> Path:
    """Log shipping: the file lands in the incoming folder under its final name (atomic copy + rename)."""
    incoming.mkdir(parents=True, exist_ok=True)
    tmp = incoming / f".{log.name}.part"
    shutil.copy(log, tmp)
    os.replace(tmp, incoming / log.name)
    return incoming / log.name


# --------------------------------------------------------------------------------------------------
# Two promotions, then a worse candidate, then a rollback
# --------------------------------------------------------------------------------------------------


HOOK = """import json, os, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"argv": sys.argv[2:], "event": os.environ["DFLASH_EVENT"]}) + "\\n")
"""


@pytest.fixture(scope="module")
def lifecycle(target, traffic, make_hostile_lines, tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle")
    state, incoming = root / "state", root / "incoming"
    (root / "hook.py").write_text(HOOK)
    # retrain.on_promote: a command told about every version that becomes current.
    args = overrides(target, state, [incoming], f"retrain.on_promote=[{sys.executable}, {root / 'hook.py'}, "
                                                f"{root / 'hook.jsonl'}, '{{version}}', '{{bf16}}']")
    # Cycle 1's log holds lines that once stopped every cycle (huge integers, deep nesting, ...).
    hostile = make_hostile_lines(HOSTILE, seed=1, max_record_bytes=MAX_RECORD_BYTES)
    ship(with_hostile_lines(traffic(SEEDS["cycle1"]), root / "shipped" / "traffic-1.jsonl.gz", hostile), incoming)
    out1 = ok(retrain(*args))
    link_after_1 = os.readlink(state / "current")
    ship(traffic(SEEDS["cycle2"], PREFILL), incoming)
    out2 = ok(retrain(*args))
    return {"root": root, "state": state, "incoming": incoming, "out": [out1, out2], "link_after_1": link_after_1}


def test_two_cycles_promote_better_drafters(lifecycle, target, traffic):
    from drafters.drafter.checkpoint import load_drafter
    from drafters.export.contract import check_folder
    from transformers import AutoConfig

    state_dir = lifecycle["state"]
    out1, out2 = lifecycle["out"]
    assert "bootstrap: v0000" in out1 and "cycle 1: promoted" in out1 and "cycle 2: promoted" in out2
    assert lifecycle["link_after_1"] == "versions/v0001"
    assert os.readlink(state_dir / "current") == "versions/v0002"
    state = state_of(state_dir)
    assert state["cycle"] == 2 and state["promoted"] == "v0002" and state["in_progress"] is None
    assert sorted(state["versions"]) == ["v0000", "v0001", "v0002"]
    assert state["versions"]["v0002"]["parent"] == "v0001" and state["versions"]["v0001"]["parent"] == "v0000"
    history = history_of(state_dir)
    assert [r["id"] for r in history] == ["bootstrap-v0000", "cycle-000001", "cycle-000002"]
    c1, c2 = history[1], history[2]
    # The engine was told about each version as it became current, with its bf16 export.
    told = [json.loads(line) for line in (lifecycle["root"] / "hook.jsonl").read_text().splitlines()]
    assert [(t["event"], t["argv"][0]) for t in told] == [("bootstrap", "v0000"), ("promote", "v0001"), ("promote", "v0002")]
    assert all(t["argv"][1] == str(state_dir / "versions" / t["argv"][0] / "bf16") for t in told)

    # The random initial drafter accepts nothing; each candidate beats the drafter it was fine-tuned from
    # on the same held-out traffic, by more than the margin, with the target's exact greedy output.
    assert c1["tau_current"] == pytest.approx(1.0)
    for rec, parent, version in ((c1, "v0000", "v0001"), (c2, "v0001", "v0002")):
        assert rec["status"] == "promoted" and rec["promoted_version"] == version
        assert rec["current_version"] == parent
        assert rec["train"]["init_from"] == str(state_dir / "versions" / parent / "drafter")
        assert rec["train"]["steps"] == 10
        assert rec["tau_candidate"] > rec["tau_current"] * 1.02 and rec["tau_candidate"] > 2.0
        assert rec["eval"]["prompts"] == 2 and rec["eval"]["mismatched_current"] == 0
        assert rec["eval"]["mismatched_candidate"] == 0 and rec["eval"]["mismatches"] == []
        assert rec["eval"]["heldout_files"][0] == rec["heldout_file"]
        # The cycle's training read the prefix-tree cache: the target ran once per unique token of its rows.
        features = rec["features"]
        assert features["layout"] == "tree" and features["complete"]
        assert features["target_tokens"] == features["cached_tokens"] <= rec["tokens"]["unique_train"] < features["row_tokens"]
    # Cycle 2's traffic drifted (prefilled turns): the cycle-1 drafter no longer predicts the target.
    assert c2["tau_current"] < 1.5
    items = [json.loads(line) for line in Path(c1["quarantine_file"]).read_text().splitlines()]
    assert len(items) == HOSTILE and all(it["source_file"] == c1["files"][0]["path"] and it["line"] for it in items)
    assert {"number_too_large", "nesting_too_deep", "record_too_large"} <= set(c1["requests"]["by_reason"])

    # Data accounting of each cycle reconciles with the files it read: every good line was taken, every
    # hostile line of cycle 1 quarantined (and cycle 1 still promoted, above).
    for rec, (seed, prefill), hostile in ((c1, (SEEDS["cycle1"], ""), HOSTILE), (c2, (SEEDS["cycle2"], PREFILL), 0)):
        (entry,) = rec["files"]
        records, _ = load_trajectories(entry["path"], VOCAB, max_record_bytes=MAX_RECORD_BYTES)
        clean, _ = load_trajectories(traffic(seed, prefill), VOCAB)
        assert [r.request_id for r in records] == [r.request_id for r in clean]
        assert entry["status"] == "ingested" and entry["accepted"] == len(records)
        assert entry["read"] == len(records) + hostile and entry["quarantined"] == hostile
        assert rec["requests"]["read"] == len(records) + hostile and rec["requests"]["accepted"] == len(records)
        assert rec["requests"]["quarantined"] == sum(rec["requests"]["by_reason"].values()) == hostile
        split = rec["split"]
        assert split["train_requests"] + split["heldout_requests"] == len(records)
        assert split["root_sessions"] == 3 and split["heldout_sessions"] >= 1 and split["train_sessions"] >= 2
        assert rec["tokens"]["logged"] == sum(r.num_tokens for r in records)
        assert rec["tokens"]["unique_train"] < rec["tokens"]["logged_train"] and rec["tokens"]["dedup_ratio"] > 1

        # Held out BEFORE training: whole sessions (a sub-agent follows its parent), none in the dataset.
        held, _ = load_trajectories(rec["heldout_file"], VOCAB)
        held_sessions = {r.session_id for r in held}
        for r in records:
            parent = r.metadata.get("parent_session_id")
            if parent:
                assert (r.session_id in held_sessions) == (parent in held_sessions)
        assert {r.request_id for r in held} == {r.request_id for r in records if r.session_id in held_sessions}
        from datasets import load_from_disk

        dataset = load_from_disk(rec["dataset"]["path"])
        trained = {rid for p in dataset["provenance"] for rid in p["request_ids"]}
        assert trained and not trained & {r.request_id for r in held}

    # Every version holds the drafter, checked bf16 and FP8 exports and (for promoted ones) the eval report.
    target_config = AutoConfig.from_pretrained(target)
    for version in ("v0000", "v0001", "v0002"):
        vdir = state_dir / "versions" / version
        info = json.loads((vdir / "version.json").read_text())
        assert info["version"] == version
        load_drafter(vdir / "drafter", target_config=target_config)
        assert check_folder(vdir / "bf16", "bf16")["tensors"] > 0
        assert check_folder(vdir / "fp8", "fp8")["tensors"] > 0
        assert json.loads((vdir / "fp8" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    report = json.loads((state_dir / "versions" / "v0002" / "eval" / "report.json").read_text())
    assert report["categories"]["agentic"]["methods"]["candidate"]["tau_mean"] == pytest.approx(c2["tau_candidate"])
    assert (state_dir / "current" / "bf16" / "model.safetensors").is_file()  # what a server loads
    # Committed cycles drop their optimizer checkpoints.
    assert not (Path(c2["cycle_dir"]) / "train" / "checkpoints").exists()


def test_worse_candidate_is_not_promoted_and_rollback(lifecycle, traffic, target, tmp_path):
    state_dir = copy_state(lifecycle["state"], tmp_path / "state")
    before = state_of(state_dir)
    extra = tmp_path / "incoming-more"
    new_file = ship(traffic(SEEDS["cycle3"], PREFILL), extra)
    args = overrides(target, state_dir, [lifecycle["incoming"], extra], "retrain.shuffle_training_tokens=true")
    out = ok(retrain(*args))
    assert "tokens SHUFFLED" in out and "cycle 3: not_promoted" in out and "v0002 stays current" in out
    rec = history_of(state_dir)[-1]
    assert rec["cycle"] == 3 and rec["status"] == "not_promoted" and rec["promoted_version"] is None
    assert rec["dataset"]["shuffled_tokens"] is True
    assert rec["tau_candidate"] < rec["tau_current"]  # worse, not merely not better enough
    assert os.readlink(state_dir / "current") == "versions/v0002"
    state = state_of(state_dir)
    assert state["promoted"] == "v0002" and sorted(state["versions"]) == sorted(before["versions"])
    assert sorted(p.name for p in (state_dir / "versions").iterdir()) == ["v0000", "v0001", "v0002"]
    assert (Path(rec["cycle_dir"]) / "candidate" / "model.safetensors").is_file()
    # Only the new file was read; the two consumed ones were not read again.
    assert [f["path"] for f in rec["files"]] == [str(new_file)]
    assert state["consumed"][str(new_file)]["cycle"] == 3 and len(state["consumed"]) == 3
    # The gate read this cycle's held-out traffic first, then the window's earlier cycles.
    assert rec["eval"]["heldout_files"][0] == rec["heldout_file"] and len(rec["eval"]["heldout_files"]) == 3

    # Rollback: `current` moves to an earlier version, atomically, and it is recorded; an http hook is POSTed.
    import http.server
    import threading

    posted = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            posted.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hook = f"retrain.on_promote=http://127.0.0.1:{server.server_address[1]}/promoted"
    ok(retrain(*overrides(target, state_dir, [lifecycle["incoming"], extra]), hook, "--rollback", "v0001"))
    server.shutdown()
    assert [(p["event"], p["version"]) for p in posted] == [("rollback", "v0001")]
    assert posted[0]["bf16"] == str(state_dir / "versions" / "v0001" / "bf16")
    assert os.readlink(state_dir / "current") == "versions/v0001"
    # A hook that fails leaves the version current, exits 4, and --notify tells the engine again.
    failing = retrain(*overrides(target, state_dir, [lifecycle["incoming"]]), "retrain.on_promote=[sh, -c, 'exit 3']",
                      "--rollback", "v0002")
    assert failing.returncode == 4 and "is committed, but retrain.on_promote" in failing.stderr
    assert os.readlink(state_dir / "current") == "versions/v0002"
    retold = retrain(*overrides(target, state_dir, [lifecycle["incoming"]]),
                     f"retrain.on_promote=[{sys.executable}, {lifecycle['root'] / 'hook.py'}, {tmp_path / 'again.jsonl'}, "
                     "'{version}']", "--notify")
    assert retold.returncode == 0 and json.loads((tmp_path / "again.jsonl").read_text())["argv"] == ["v0002"]
    ok(retrain(*overrides(target, state_dir, [lifecycle["incoming"], extra]), "--rollback", "v0001"))
    assert state_of(state_dir)["promoted"] == "v0001"
    last = history_of(state_dir)[-1]
    assert last["event"] == "rollback" and last["from_version"] == "v0002" and last["to_version"] == "v0001"
    refused = retrain(*overrides(target, state_dir, [lifecycle["incoming"]]), "--rollback", "v0042")
    assert refused.returncode == 2 and "v0042" in refused.stderr
    assert os.readlink(state_dir / "current") == "versions/v0001"


def test_reshipped_requests_are_quarantined_and_the_gate_window_does_not_grow(lifecycle, traffic, target, tmp_path):
    state_dir = copy_state(lifecycle["state"], tmp_path / "state")
    before = state_of(state_dir)
    # Retried log shipping: cycle 1's requests and some of cycle 2's again, in other bytes (decompressed,
    # reordered, re-batched into other files and formats).
    first, _ = load_trajectories(traffic(SEEDS["cycle1"]), VOCAB)
    second, _ = load_trajectories(traffic(SEEDS["cycle2"], PREFILL), VOCAB)
    resent = tmp_path / "resent"
    write_trajectories(list(reversed(first)), resent / "retry-a.jsonl")
    write_trajectories(second[:5], resent / "retry-b.parquet")
    out = ok(retrain(*overrides(target, state_dir, [lifecycle["incoming"], resent])))
    assert "cycle 3: quarantined_only" in out
    rec = history_of(state_dir)[-1]
    n = len(first) + 5
    assert rec["requests"]["read"] == rec["requests"]["quarantined"] == n
    assert rec["requests"]["by_reason"] == {"already_consumed": n}
    items = [json.loads(line) for line in Path(rec["quarantine_file"]).read_text().splitlines()]
    assert Counter(it["consumed_in"] for it in items) == {"cycle 1": len(first), "cycle 2": 5}
    assert all("already consumed by cycle" in it["message"] for it in items)
    # Nothing trained, nothing joined the gate's held-out window, nothing remembered twice.
    after = state_of(state_dir)
    sd = StateDir(state_dir)
    window = lambda state: [f for f in (cycle_heldout_file(sd, e) for e in state["cycles"]) if f]  # noqa: E731
    assert window(after) == window(before) and len(window(after)) == 2
    assert after["requests"] == before["requests"] and after["promoted"] == before["promoted"]
    assert not (Path(rec["cycle_dir"]) / "train").exists()


def test_truncated_state_file_is_named(lifecycle, target, tmp_path):
    state_dir = copy_state(lifecycle["state"], tmp_path / "state")
    text = (state_dir / "state.json").read_text()
    (state_dir / "state.json").write_text(text[: len(text) // 2])
    for extra in ([], ["--status"]):
        result = retrain(*overrides(target, state_dir, [lifecycle["incoming"]]), *extra)
        assert result.returncode == 2, result.stderr[-3000:]
        assert f"{state_dir / 'state.json'} is not readable JSON" in result.stderr
        assert "Traceback" not in result.stderr
    assert (state_dir / "state.json").read_text() == text[: len(text) // 2]


# --------------------------------------------------------------------------------------------------
# A killed cycle resumes and consumes every file exactly once
# --------------------------------------------------------------------------------------------------


def test_killed_cycle_resumes_and_consumes_each_file_once(target, traffic, tmp_path):
    state_dir, incoming = tmp_path / "state", tmp_path / "incoming"
    files = [ship(traffic(SEEDS["cycle1"]), incoming), ship(traffic(SEEDS["cycle2"], PREFILL), incoming)]
    args = overrides(target, state_dir, [incoming], "train.max_steps=30", "train.save_every=2", "train.keep_last=10")
    checkpoints = state_dir / "cycles" / "cycle-000001" / "train" / "checkpoints"
    proc = subprocess.Popen([sys.executable, str(RETRAIN), "--config", str(CONFIG), *args], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if checkpoints.exists() and any(p.name.startswith("step-") for p in checkpoints.iterdir()):
            break
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-"))
    assert saved and saved[-1] != "step-000030", "the cycle finished before it could be killed"

    # Killed mid-training: nothing consumed, nothing promoted, the promoted drafter intact.
    state = state_of(state_dir)
    assert state["consumed"] == {} and state["requests"] == {} and state["cycle"] == 0 and state["promoted"] == "v0000"
    assert state["in_progress"]["cycle"] == 1
    assert sorted(f["path"] for f in state["in_progress"]["files"]) == sorted(map(str, files))
    assert os.readlink(state_dir / "current") == "versions/v0000"
    assert (state_dir / "current" / "drafter" / "model.safetensors").is_file()
    assert [r["id"] for r in history_of(state_dir)] == ["bootstrap-v0000"]

    out = ok(retrain(*args))
    assert "resuming interrupted cycle 1" in out and f"resumed from {checkpoints}" in out
    state = state_of(state_dir)
    assert state["in_progress"] is None and state["cycle"] == 1
    assert sorted(state["consumed"]) == sorted(map(str, files))
    assert all(v["cycle"] == 1 for v in state["consumed"].values())
    cycles = [r for r in history_of(state_dir) if r.get("event") == "cycle"]
    assert len(cycles) == 1 and cycles[0]["cycle"] == 1 and cycles[0]["status"] in ("promoted", "not_promoted")
    rec = cycles[0]
    assert rec["train"]["steps"] == 30
    total = 0
    for f in files:
        records, _ = load_trajectories(f, VOCAB)
        entry = next(e for e in rec["files"] if e["path"] == str(f))
        assert entry["read"] == entry["accepted"] == len(records)
        assert state["consumed"][str(f)]["accepted"] == len(records)
        total += len(records)
    assert rec["requests"]["read"] == rec["requests"]["accepted"] == total
    assert len(state["requests"]) == total and set(state["requests"].values()) == {1}
    assert rec["split"]["train_requests"] + rec["split"]["heldout_requests"] == total

    # The next cycle neither re-reads nor double-counts anything.
    out = ok(retrain(*args))
    assert "cycle 2: no new data" in out
    state = state_of(state_dir)
    assert sorted(state["consumed"]) == sorted(map(str, files)) and state["cycle"] == 2
    assert [r["status"] for r in history_of(state_dir) if r.get("event") == "cycle"] == [rec["status"], "no_new_data"]


# --------------------------------------------------------------------------------------------------
# Nothing to do: no new data, only quarantined data, a cycle already running
# --------------------------------------------------------------------------------------------------


def test_no_new_data_does_nothing_and_says_so(lifecycle, target, tmp_path):
    state_dir = copy_state(lifecycle["state"], tmp_path / "state")
    args = overrides(target, state_dir, [lifecycle["incoming"]])
    out = ok(retrain(*args))
    assert "cycle 3: no new data" in out and "nothing to do" in out
    state = state_of(state_dir)
    assert state["cycle"] == 3 and state["promoted"] == "v0002" and len(state["consumed"]) == 2
    assert not (state_dir / "cycles" / "cycle-000003").exists()
    assert os.readlink(state_dir / "current") == "versions/v0002"
    rec = history_of(state_dir)[-1]
    assert rec["status"] == "no_new_data" and rec["promoted"] is False and rec["files"] == []

    # A second cycle while one holds the lock does not start.
    with open(state_dir / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        busy = retrain(*args)
    assert busy.returncode == 75 and "another retrain cycle" in busy.stderr
    assert state_of(state_dir)["cycle"] == 3


def test_quarantined_only_data_does_nothing(target, tmp_path):
    state_dir, incoming = tmp_path / "state", tmp_path / "incoming"
    incoming.mkdir()
    good = {"session_id": "s", "request_id": "r", "timestamp": 1_700_000_000.0, "input_ids": [1, 2, 3],
            "output_ids": [4, 5]}
    lines = [
        "{not json",
        json.dumps({**good, "request_id": "r1", "output_ids": [4, VOCAB + 7]}),  # out of vocabulary
        json.dumps({**good, "request_id": "r2", "output_ids": []}),  # empty output
        json.dumps({k: v for k, v in good.items() if k != "input_ids"}),  # missing field
    ]
    bad = incoming / "bad-traffic.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write("\n".join(lines) + "\n")
    args = overrides(target, state_dir, [incoming], "logging.wandb=true", "logging.wandb_mode=offline")
    out = ok(retrain(*args))
    assert "cycle 1: quarantined_only" in out
    rec = history_of(state_dir)[-1]
    assert rec["status"] == "quarantined_only" and rec["promoted"] is False
    assert rec["requests"]["read"] == 4 and rec["requests"]["accepted"] == 0 and rec["requests"]["quarantined"] == 4
    assert rec["requests"]["by_reason"] == {"empty_output": 1, "malformed_json": 1, "missing_field": 1,
                                            "out_of_vocab": 1}
    quarantine = Path(rec["quarantine_file"])
    assert len(quarantine.read_text().splitlines()) == 4
    cdir = Path(rec["cycle_dir"])
    assert not (cdir / "dataset").exists() and not (cdir / "train").exists() and not (cdir / "eval").exists()
    state = state_of(state_dir)
    assert state["consumed"][str(bad)]["status"] == "quarantined_only" and state["promoted"] == "v0000"
    assert sorted(state["versions"]) == ["v0000"] and os.readlink(state_dir / "current") == "versions/v0000"
    # Metrics went to wandb too (offline run files under the state dir).
    assert list((state_dir / "wandb").glob("offline-run-*"))

    # Quarantined-only files are consumed: the next cycle does not read them again.
    out = ok(retrain(*overrides(target, state_dir, [incoming])))
    assert "cycle 2: no new data" in out


# --------------------------------------------------------------------------------------------------
# File identity and the held-out split (in process, real files)
# --------------------------------------------------------------------------------------------------


def test_file_identity_notices_rewrites_and_duplicate_content(tmp_path):
    sd = StateDir(tmp_path / "state")
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    a, b = incoming / "a.jsonl", incoming / "b.jsonl"
    a.write_text('{"x": 1}\n')
    b.write_text('{"x": 2}\n')
    (incoming / ".c.jsonl.part").write_text("half-written")  # a log shipper's temp file: not picked up
    state = new_state()
    found = {Path(f["path"]).name: f for f in discover([str(incoming)], state, sd)}
    assert set(found) == {"a.jsonl", "b.jsonl"} and {f["status"] for f in found.values()} == {"new"}
    for f in found.values():
        state["consumed"][f["path"]] = {"size": f["size"], "sha256": f["sha256"], "cycle": 1}
    assert discover([str(incoming)], state, sd) == []
    a.write_text('{"x": 3}\n')  # same size, new content: a rewrite is noticed by the hash
    (incoming / "b-copy.jsonl").write_text('{"x": 2}\n')  # re-shipped under another name
    again = {Path(f["path"]).name: f for f in discover([str(incoming)], state, sd)}
    assert again["a.jsonl"]["status"] == "rewritten" and again["a.jsonl"]["previous"]["cycle"] == 1
    assert again["b-copy.jsonl"]["status"] == "duplicate_content"
    assert again["b-copy.jsonl"]["duplicate_of"] == str(b.absolute())


def test_split_is_by_root_session_and_deterministic(traffic):
    records, _ = load_trajectories(traffic(SEEDS["cycle2"], PREFILL), VOCAB)
    roots = session_roots(records, {})
    subs = {r.session_id: r.metadata["parent_session_id"] for r in records if r.metadata.get("parent_session_id")}
    assert subs and all(roots[s] == p for s, p in subs.items())
    # Without its first request (the one whose parent_request_id names the parent's request) and without
    # the metadata hint, a sub-agent falls back to a link remembered from an earlier cycle, else its own id.
    later = [r for r in records if r.session_id in subs and r.parent_request_id
             and r.parent_request_id.startswith(r.session_id)]
    stripped = [type(r)(**{**r.__dict__, "metadata": {}}) for r in later]
    assert all(v == k for k, v in session_roots(stripped, {}).items())
    remembered = {s: [p, 1] for s, p in subs.items()}
    assert session_roots(stripped, remembered) == {r.session_id: subs[r.session_id] for r in stripped}
    assert is_heldout("session-x", 0.5) == is_heldout("session-x", 0.5)
    share = sum(is_heldout(f"s{i}", 0.25) for i in range(4000)) / 4000
    assert 0.22 < share < 0.28
