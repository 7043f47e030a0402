"""The user's own prompts in the mixture: three formats in three file types beside a built-in corpus, prepared by
the real command with the real testbed target; bad records quarantined and counted per source."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from datasets import load_from_disk

from configs.schema import ConfigError, load_config
from drafters.target.chat import load_tokenizer
from data.sources.user_files import read_source

REPO = Path(__file__).resolve().parents[1]
LONG = "word " * 800  # over the prompt budget of max_prompt_tokens 256 x 3 characters


def _messages_jsonl(path: Path) -> dict:
    """Good chats (one with two user turns) among bad lines; returns the expected quarantine reasons."""
    good = [{"messages": [{"role": "system", "content": "You are terse."},
                          {"role": "user", "content": "Name a prime number."},
                          {"role": "assistant", "content": "7"},
                          {"role": "user", "content": "Now name a larger one."}]}]
    good += [{"messages": [{"role": "user", "content": f"Write a Python function that returns {n} squared."}]}
             for n in range(2, 14)]
    lines = [json.dumps(g) for g in good]
    bad = {
        "malformed_json": '{"messages": [{"role": "user", "content": "unclosed"',
        "not_an_object": "[1, 2, 3]",
        "wrong_type": json.dumps({"messages": "hello"}),
        "unknown_role": json.dumps({"messages": [{"role": "tool", "content": "{}"}]}),
        "no_user_turn": json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}),
        "duplicate": lines[0],
        "too_long": json.dumps({"messages": [{"role": "user", "content": LONG}]}),
        "empty": json.dumps({"messages": [{"role": "user", "content": "   "}]}),
    }
    for i, line in enumerate(bad.values()):
        lines.insert(2 * i + 1, line)
    path.write_text("\n".join(lines) + "\n")
    return {reason: 1 for reason in bad}


def _sharegpt_json(path: Path) -> dict:
    records = [{"conversations": [{"from": "human", "value": f"Explain what a Python {w} is, in one sentence."},
                                  {"from": "gpt", "value": "An answer to be replaced."}]}
               for w in ("list", "tuple", "dict", "set", "generator", "decorator", "class", "module", "lambda", "slice")]
    records.append({"id": "no-conversations", "text": "hello"})
    records.append({"conversations": [{"from": "narrator", "value": "Once upon a time"}]})
    path.write_text(json.dumps(records))
    return {"missing_field": 1, "unknown_role": 1}


def _prompt_parquet(path: Path) -> dict:
    prompts = [f"Give one tip for writing readable code, number {i}." for i in range(10)] + [None]
    pq.write_table(pa.table({"prompt": prompts}), path)
    return {"wrong_type": 1}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    expected = {"chats": _messages_jsonl(root / "chats.jsonl"), "sharegpt": _sharegpt_json(root / "sharegpt.json"),
                "tips": _prompt_parquet(root / "tips.parquet")}
    entries = [
        {"path": str(root / "chats.jsonl"), "format": "messages", "category": "code", "turns": "every"},
        {"path": str(root / "sharegpt.json"), "format": "conversations", "category": "chat"},
        {"path": str(root / "tips.parquet"), "format": "prompt", "category": "advice"},
        {"builtin": "chat", "weight": 1.0},
    ]
    return root, entries, expected


def _write_config(path: Path, entries: list, num_samples: int, cache: Path, target: Path, **mixture) -> Path:
    config = {"cache_dir": str(cache), "target": {"path": str(target), "dtype": "fp32"},
              "data": {"mixture": {"sources": entries, "num_samples": num_samples, "max_prompt_tokens": 256,
                                   "max_new_tokens": 4, "generation_batch_size": 16, **mixture}},
              "logging": {"wandb": False}}
    path.write_text(yaml.safe_dump(config))
    return path


def _prepare(config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "scripts.cli", "prepare", "--config", str(config)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def _train_side(entries: list, root: Path) -> dict[str, int]:
    held = {}
    for entry in entries:
        if "path" in entry:
            name = Path(entry["path"]).name.split(".")[0]
            read = read_source(name, entry["path"], entry["format"], entry["category"], split="train",
                               heldout_fraction=0.1, max_chars=256 * 3, turns=entry.get("turns", "last"))
            held[name] = len(read.prompts)
    return held


def test_a_mixture_from_three_user_formats_and_a_builtin_corpus(sources, testbed_target, tmp_path):
    root, entries, expected = sources
    held = _train_side(entries, root)
    assert min(held.values()) >= 6
    # Weights in proportion to what each source holds: every user prompt is drawn, the built-in chat gives 8.
    weighted = [{**e, "weight": held[Path(e["path"]).name.split(".")[0]]} if "path" in e else {**e, "weight": 8}
                for e in entries]
    total = sum(held.values()) + 8
    config = _write_config(tmp_path / "mixture.yaml", weighted, total, tmp_path / "cache", testbed_target)

    result = _prepare(config)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads(result.stdout.splitlines()[-1])
    by_name = {s["name"]: s for s in manifest["sources"]}
    assert set(by_name) == {"chats", "sharegpt", "tips", "chat"}
    for name, reasons in expected.items():
        entry = by_name[name]
        assert entry["accepted"] + entry["quarantined"] == entry["read"], entry
        assert entry["quarantined_by_reason"] == reasons and entry["drawn"] == entry["in_split"] == held[name]
        assert entry["content_sha256"] and entry["format"]
    assert by_name["chat"]["builtin"] == "chat" and by_name["chat"]["drawn"] == 8
    assert manifest["prompts"] == total
    assert manifest["target"]["fingerprint"].startswith("blake2b-target:") and manifest["target"]["chat_template_sha256"]
    assert manifest["quarantine"]["sources"] == sum(sum(r.values()) for r in expected.values())

    logged = result.stdout + result.stderr
    folder = Path(next(line.split("-> ")[-1] for line in logged.splitlines() if "general mixture:" in line))
    quarantine = [json.loads(line) for line in (folder / "sources_quarantine.jsonl").read_text().splitlines()]
    assert len(quarantine) == manifest["quarantine"]["sources"]
    assert all(q["reason"] and q["source_file"] and (q.get("line") is not None or q.get("row") is not None) for q in quarantine)
    assert {q.get("line") for q in quarantine if q["source_file"].endswith("chats.jsonl")} == {2, 4, 6, 8, 10, 12, 14, 16}

    dataset = load_from_disk(str(folder / "dataset"))
    assert {pid.split(":")[0] for pid in dataset["prompt_id"]} == {"chats", "sharegpt", "tips", "chat"}
    assert {"code", "chat", "advice"} <= set(dataset["category"])
    # `turns: every`: the second user turn is answered after the target's own first answer, as a row of its own
    second = [i for i, pid in enumerate(dataset["prompt_id"]) if pid.endswith("@turn2")]
    assert len(second) == 1 and manifest["generation"]["rounds"] == 2
    row = dataset[second[0]]
    text = load_tokenizer(testbed_target).decode(row["input_ids"][:row["num_prompt_tokens"]])
    assert "Name a prime number." in text and "Now name a larger one." in text and "7" not in text.split("prime")[1][:20]


def test_more_samples_than_the_sources_hold_is_refused_before_regeneration(sources, testbed_target, tmp_path):
    root, entries, _ = sources
    held = _train_side(entries, root)
    config = _write_config(tmp_path / "greedy.yaml", entries, 4 * max(held.values()) + 40, tmp_path / "cache",
                           testbed_target)
    result = _prepare(config)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "asks for more prompts than the sources hold" in result.stderr and "data.mixture.accept_fewer" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "cache" / "datasets").exists()


def test_the_held_out_split_does_not_depend_on_file_order(sources, tmp_path):
    root, _, _ = sources
    lines = (root / "chats.jsonl").read_text().splitlines()
    (tmp_path / "reversed.jsonl").write_text("\n".join(reversed(lines)) + "\n")
    ids = {}
    for name, path in (("a", root / "chats.jsonl"), ("b", tmp_path / "reversed.jsonl")):
        for split in ("train", "heldout"):
            read = read_source("chats", path, "messages", "code", split=split, heldout_fraction=0.3, max_chars=768)
            ids[name, split] = {p.id for p in read.prompts}
    assert ids["a", "train"] == ids["b", "train"] and ids["a", "heldout"] == ids["b", "heldout"]
    assert ids["a", "heldout"] and not ids["a", "train"] & ids["a", "heldout"]


def test_source_settings_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match="data.mixture.sources"):
        load_config(None, ["data.mixture.weights={code: 1}", "data.mixture.sources=[{builtin: code}]"])
    with pytest.raises(ConfigError, match="format"):
        load_config(None, ["data.mixture.sources=[{path: x.jsonl}]"])
    with pytest.raises(ConfigError, match="exactly one"):
        load_config(None, ["data.mixture.sources=[{path: x.jsonl, builtin: code, format: prompt}]"])
    with pytest.raises(ConfigError, match="repeat"):
        load_config(None, ["data.mixture.sources=[{builtin: code}, {path: code.jsonl, format: prompt}]"])
    config = load_config(None, ["data.mixture.sources=[{builtin: code, weight: 2}, {path: a/b.jsonl, format: prompt}]"])
    assert [(s.source_name, s.source_category) for s in config.data.mixture.source_list] == [("code", "code"), ("b", "chat")]
    assert [s.builtin for s in load_config(None, []).data.mixture.source_list] == ["code", "prose", "chat"]


def test_two_processes_share_the_regeneration(sources, testbed_target, tmp_path):
    """`accelerate launch -m scripts.cli prepare` on 2 processes: each regenerates its share (shards of its own), the
    main one writes the dataset. (A share resumes like a single process's regeneration: tests/test_regenerate.py.)"""
    root, entries, _ = sources
    config = _write_config(tmp_path / "shared.yaml", [entries[2]], 8, tmp_path / "cache", testbed_target)
    launch = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
              str(REPO / "configs" / "accelerate" / "ddp.yaml"), "-m", "scripts.cli", "prepare", "--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    first = subprocess.run(launch, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads(first.stdout.strip().splitlines()[-1])
    folder = next((tmp_path / "cache" / "datasets").iterdir())
    shards = sorted(p.name for p in (folder / "work").glob("shard-*.parquet"))
    assert {name[:10] for name in shards} == {"shard-r000", "shard-r001"}, shards  # both processes generated
    dataset = load_from_disk(str(folder / "dataset"))
    assert len(dataset) == manifest["rows"] == manifest["prompts"] == 8
    assert sorted(dataset["prompt_id"]) == sorted(set(dataset["prompt_id"]))
