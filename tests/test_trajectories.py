"""Trajectory ingestion: validation, quarantine, reconciliation, writer round trips (real files)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.trajectory.reader import (
    REASONS,
    IngestSummary,
    ReconciliationError,
    TrajectoryReader,
    load_trajectories,
    validate_record,
    InvalidRecord,
    write_trajectories,
)

VOCAB = 1000


def rec(i: int, session: str = "s0", **overrides):
    r = {
        "session_id": session,
        "request_id": f"{session}-r{i}",
        "input_ids": [(7 * i + j) % VOCAB for j in range(5 + i)],
        "output_ids": [(11 * i + j) % VOCAB for j in range(3)],
        "timestamp": 1_700_000_000.0 + i,
    }
    r.update(overrides)
    return r


def write_lines(path: Path, lines: list) -> Path:
    """Write raw JSONL lines (str lines are written verbatim, anything else is json-dumped)."""
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def read(paths, tmp_path: Path, vocab: int = VOCAB):
    qpath = tmp_path / "quarantine" / "q.jsonl"
    reader = TrajectoryReader(paths, vocab, quarantine_path=qpath)
    records = list(reader)
    summary = reader.summary.check()
    items = [json.loads(line) for line in qpath.read_text().splitlines()]
    assert len(items) == summary.quarantined
    return records, summary, items


def only_item(items, reason):
    hits = [it for it in items if it["reason"] == reason]
    assert len(hits) == 1, items
    return hits[0]


# ---------------------------------------------------------------------------------------------------
# Validation cases
# ---------------------------------------------------------------------------------------------------


def test_valid_records_are_accepted_with_types(tmp_path):
    lines = [
        rec(0),
        rec(1, timestamp="2025-03-01T12:00:00Z", parent_request_id="s0-r0", metadata={"model": "k2"}),
        rec(2, timestamp="2025-03-01T12:00:00"),  # naive ISO -> UTC
        rec(3, input_ids=[VOCAB - 1, 0], output_ids=[VOCAB - 1]),  # vocab boundary is valid
    ]
    records, s, items = read(write_lines(tmp_path / "a.jsonl", lines), tmp_path)
    assert [r.request_id for r in records] == ["s0-r0", "s0-r1", "s0-r2", "s0-r3"]
    assert items == [] and s.read == 4 and s.accepted == 4 and s.quarantined == 0
    r1 = records[1]
    assert r1.input_ids.dtype == np.int32 and r1.input_ids.tolist() == lines[1]["input_ids"]
    assert r1.output_ids.tolist() == lines[1]["output_ids"]
    assert r1.parent_request_id == "s0-r0" and r1.metadata == {"model": "k2"}
    assert r1.timestamp == pytest.approx(1740830400.0) and records[2].timestamp == pytest.approx(1740830400.0)
    assert records[0].parent_request_id is None and records[0].metadata == {}
    assert r1.source.endswith("a.jsonl:2")
    assert s.accepted_input_tokens == sum(len(x["input_ids"]) for x in lines)


def test_malformed_json_is_quarantined_and_run_continues(tmp_path):
    p = write_lines(tmp_path / "a.jsonl", [rec(0), '{"session_id": "s0", "request_id": ', rec(2), "not json at all"])
    records, s, items = read(p, tmp_path)
    assert [r.request_id for r in records] == ["s0-r0", "s0-r2"]
    assert s.by_reason == {"malformed_json": 2}
    assert [it["line"] for it in items] == [2, 4]
    assert items[0]["source_file"] == str(p) and items[0]["raw"] == '{"session_id": "s0", "request_id": '
    assert f"{p}:2" in items[0]["message"]


def test_missing_fields(tmp_path):
    no_input = rec(1)
    del no_input["input_ids"]
    no_ts = rec(2)
    del no_ts["timestamp"]
    lines = [rec(0), no_input, rec(3, session_id=None), no_ts]
    records, s, items = read(write_lines(tmp_path / "a.jsonl", lines), tmp_path)
    assert [r.request_id for r in records] == ["s0-r0"]
    assert s.by_reason == {"missing_field": 3}
    assert "input_ids" in items[0]["message"] and "s0-r1" in items[0]["message"] and ":2" in items[0]["message"]
    assert "session_id" in items[1]["message"] and "timestamp" in items[2]["message"]
    assert items[0]["request_id"] == "s0-r1"


def test_wrong_types(tmp_path):
    lines = [
        rec(0, input_ids="1 2 3"),
        rec(1, session_id=17),
        [1, 2, 3],  # not an object
        rec(3, metadata=["a"]),
        rec(4, timestamp=True),
        rec(5, parent_request_id=5),
        rec(6),
    ]
    records, s, items = read(write_lines(tmp_path / "a.jsonl", lines), tmp_path)
    assert [r.request_id for r in records] == ["s0-r6"]
    assert s.by_reason == {"wrong_type": 6}
    assert [it["line"] for it in items] == [1, 2, 3, 4, 5, 6]


def test_non_integer_ids(tmp_path):
    lines = [
        rec(0, input_ids=[1, 2.5, 3]),
        rec(1, output_ids=[4, 5.0]),  # 5.0 is a float in JSON: not an id
        rec(2, input_ids=[1, True, 3]),  # bool is not an id even though Python says bool <: int
        rec(3, output_ids=[4, "5"]),
        rec(4, input_ids=[1, None]),
        rec(5),
    ]
    records, s, items = read(write_lines(tmp_path / "a.jsonl", lines), tmp_path)
    assert [r.request_id for r in records] == ["s0-r5"]
    assert s.by_reason == {"non_integer_id": 5}
    assert "input_ids[1] = 2.5" in items[0]["message"] and "request_id='s0-r0'" in items[0]["message"]
    assert "input_ids[1] = True" in items[2]["message"]


def test_out_of_vocab_ids(tmp_path):
    lines = [rec(0, input_ids=[1, -1]), rec(1, output_ids=[VOCAB]), rec(2, input_ids=[2**70]), rec(3)]
    records, s, items = read(write_lines(tmp_path / "a.jsonl", lines), tmp_path)
    assert [r.request_id for r in records] == ["s0-r3"]
    assert s.by_reason == {"out_of_vocab": 3}
    assert f"output_ids[0] = {VOCAB} is out of vocabulary (vocab_size={VOCAB})" in items[1]["message"]
    # The same file with a larger vocabulary accepts the second record.
    records2, s2, _ = read(tmp_path / "a.jsonl", tmp_path / "big", vocab=VOCAB + 1)
    assert [r.request_id for r in records2] == ["s0-r1", "s0-r3"]


def test_empty_output_and_empty_input(tmp_path):
    lines = [rec(0, output_ids=[]), rec(1, input_ids=[]), rec(2)]
    records, s, items = read(write_lines(tmp_path / "a.jsonl", lines), tmp_path)
    assert [r.request_id for r in records] == ["s0-r2"]
    assert s.by_reason == {"empty_output": 1, "empty_input": 1}
    assert items[0]["reason"] == "empty_output" and items[0]["request_id"] == "s0-r0"


def test_duplicate_request_ids_second_is_quarantined(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [rec(0), rec(1), rec(0, output_ids=[9, 9])])
    b = write_lines(tmp_path / "b.jsonl", [rec(1, output_ids=[8]), rec(2)])
    # An invalid first occurrence does not block a later valid one.
    c = write_lines(tmp_path / "c.jsonl", [rec(3, output_ids=[]), rec(3)])
    records, s, items = read([a, b, c], tmp_path)
    assert [r.request_id for r in records] == ["s0-r0", "s0-r1", "s0-r2", "s0-r3"]
    assert records[0].output_ids.tolist() == rec(0)["output_ids"]  # the first one is kept
    assert s.by_reason == {"duplicate_request_id": 2, "empty_output": 1}
    dups = [it for it in items if it["reason"] == "duplicate_request_id"]
    assert [(Path(it["source_file"]).name, it["line"], it["request_id"]) for it in dups] == [
        ("a.jsonl", 3, "s0-r0"),
        ("b.jsonl", 1, "s0-r1"),
    ]


def test_blank_lines_are_not_records(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(rec(0)) + "\n\n   \n" + json.dumps(rec(1)) + "\n")
    records, s, _ = read(p, tmp_path)
    assert len(records) == 2 and s.read == 2 and s.blank_lines == 2


# ---------------------------------------------------------------------------------------------------
# Corrupt files
# ---------------------------------------------------------------------------------------------------


def many(n: int, session: str = "s0", width: int = 200):
    rng = np.random.default_rng(0)
    return [
        rec(i, session, input_ids=rng.integers(0, VOCAB, width).tolist(), output_ids=rng.integers(0, VOCAB, 20).tolist())
        for i in range(n)
    ]


def test_truncated_jsonl_gz_keeps_records_before_the_break(tmp_path):
    full = tmp_path / "full.jsonl.gz"
    originals = many(200)
    write_trajectories(originals, full)
    data = full.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    records, s, items = read(cut, tmp_path)
    assert 0 < len(records) < 200
    for r, o in zip(records, originals):  # what was kept is exactly the first records
        assert r.request_id == o["request_id"] and r.input_ids.tolist() == o["input_ids"]
    item = only_item(items, "corrupt_compressed")
    assert item["line"] == len(records) + 1 and item["source_file"] == str(cut)
    assert 0 < item["byte_offset"] <= len(data) // 2 and "truncated" in item["message"]
    assert s.read == len(records) + 1 and s.quarantined == 1


def test_corrupt_gzip_data_and_not_gzip(tmp_path):
    write_trajectories(many(100), tmp_path / "ok.jsonl.gz")
    data = bytearray((tmp_path / "ok.jsonl.gz").read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(bytes(data))
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_text(json.dumps(rec(0, "x")) + "\n")
    records, s, items = read([bad, fake], tmp_path)
    assert 0 <= len(records) < 100
    assert s.by_reason == {"corrupt_compressed": 2}
    assert {Path(it["source_file"]).name for it in items} == {"bad.jsonl.gz", "fake.jsonl.gz"}
    assert "not a gzip file" in only_item([it for it in items if "fake" in it["source_file"]], "corrupt_compressed")["message"]


def test_corrupt_parquet_row_group_and_truncated_file(tmp_path):
    originals = many(12, width=40)
    p = tmp_path / "a.parquet"
    write_trajectories(originals, p, row_group_size=4)
    meta = pq.ParquetFile(p).metadata
    assert meta.num_row_groups == 3
    names = [meta.row_group(1).column(c).path_in_schema for c in range(meta.num_columns)]
    col = meta.row_group(1).column(names.index("input_ids.list.element"))
    start = col.dictionary_page_offset or col.data_page_offset
    data = bytearray(p.read_bytes())
    for i in range(start + col.total_compressed_size - 16, start + col.total_compressed_size - 4):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))
    trunc = tmp_path / "trunc.parquet"
    trunc.write_bytes(bytes(data[: len(data) // 2]))

    records, s, items = read([p, trunc], tmp_path)
    assert [r.request_id for r in records] == [o["request_id"] for o in originals[:4] + originals[8:]]
    rg = only_item(items, "unreadable_row_group")
    assert (rg["row_group"], rg["row"], rg["lost_rows"]) == (1, 4, 4) and rg["source_file"] == str(p)
    f = only_item(items, "unreadable_file")
    assert f["source_file"] == str(trunc)
    assert s.read == 8 + 1 + 1 and s.accepted == 8


def test_parquet_rows_with_bad_values_are_validated(tmp_path):
    table = pa.table(
        {
            "session_id": ["s", "s", None],
            "request_id": ["a", "b", "c"],
            "input_ids": pa.array([[1, 2], [3, VOCAB + 5], [1]], pa.list_(pa.int64())),
            "output_ids": pa.array([[4], [5], [6]], pa.list_(pa.int64())),
            "timestamp": ["2025-01-01T00:00:00+00:00", "2025-01-01T00:00:00+00:00", "x"],
        }
    )
    pq.write_table(table, tmp_path / "other.parquet")  # written by another tool: no metadata column
    floats = pa.table(
        {
            "session_id": ["s"],
            "request_id": ["d"],
            "input_ids": pa.array([[1.5]], pa.list_(pa.float64())),
            "output_ids": pa.array([[1]], pa.list_(pa.int32())),
            "timestamp": [1.0],
        }
    )
    pq.write_table(floats, tmp_path / "floats.parquet")
    records, s, items = read(tmp_path, tmp_path)
    assert [r.request_id for r in records] == ["a"]
    assert s.by_reason == {"out_of_vocab": 1, "missing_field": 1, "non_integer_id": 1}
    oov = only_item(items, "out_of_vocab")
    assert oov["row"] == 1 and oov["request_id"] == "b" and "other.parquet#row=1" in oov["message"]
    assert json.loads(oov["raw"])["input_ids"] == [3, VOCAB + 5]


# ---------------------------------------------------------------------------------------------------
# Reconciliation and round trips
# ---------------------------------------------------------------------------------------------------


def test_reconciliation_on_a_mixed_file_set(tmp_path):
    logs = tmp_path / "logs"
    (logs / "day2").mkdir(parents=True)
    write_trajectories(many(30, "a"), logs / "a.parquet", row_group_size=10)
    write_trajectories(many(30, "b"), logs / "day2" / "b.jsonl.gz")
    gz = (logs / "day2" / "b.jsonl.gz").read_bytes()
    (logs / "day2" / "c.jsonl.gz").write_bytes(gz[: len(gz) * 2 // 3])  # truncated copy: its ids are dups
    write_lines(
        logs / "d.jsonl",
        [rec(0, "d"), "{oops", rec(1, "d", output_ids=[]), rec(2, "d", input_ids=[VOCAB]), rec(0, "d"), ""],
    )
    (logs / "e.parquet").write_bytes(b"PAR1 definitely not parquet")
    (logs / "README.txt").write_text("ignored: not a trajectory file")
    (logs / ".partial.jsonl").write_text("{half a record written by some other tool")  # dot-files skipped

    qpath = tmp_path / "q.jsonl"
    reader = TrajectoryReader([logs, logs / "d.jsonl"], VOCAB, quarantine_path=qpath)  # d.jsonl listed twice
    records = list(reader)
    s = reader.summary
    s.check()
    assert s.complete and s.reconciles()
    assert s.accepted == len(records) == 30 + 30 + 1
    assert s.accepted + s.quarantined == s.read
    assert sorted(Path(f).name for f in s.files) == ["a.parquet", "b.jsonl.gz", "c.jsonl.gz", "d.jsonl", "e.parquet"]
    c = s.files[str(logs / "day2" / "c.jsonl.gz")]
    assert c.quarantined == c.read and s.by_reason["corrupt_compressed"] == 1
    assert s.by_reason["duplicate_request_id"] == c.read - 1 + 1  # c's lines + d's repeated d-r0
    assert s.by_reason["malformed_json"] == 1 and s.by_reason["empty_output"] == 1
    assert s.by_reason["out_of_vocab"] == 1 and s.by_reason["unreadable_file"] == 1
    assert set(s.by_reason) <= set(REASONS)
    assert len(qpath.read_text().splitlines()) == s.quarantined
    assert s.to_dict()["reconciles"] is True
    # The check really checks: break the accounting and it raises.
    s.accepted += 1
    with pytest.raises(ReconciliationError, match="accepted .* != read"):
        s.check()


def test_check_raises_on_per_reason_mismatch():
    s = IngestSummary(read=3, accepted=2, quarantined=1)
    s.by_reason["malformed_json"] = 2
    with pytest.raises(ReconciliationError, match="per-reason"):
        s.check()


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl.gz", ".jsonl"])
def test_writer_round_trip(tmp_path, suffix):
    originals = [
        rec(0, parent_request_id=None, metadata={"agent": "main", "tools": ["bash"]}),
        rec(1, parent_request_id="s0-r0", metadata={}),
        rec(2, "sub", timestamp="2025-06-01T08:30:00+02:00", input_ids=[0, VOCAB - 1] * 50),
    ]
    path = tmp_path / f"t{suffix}"
    assert write_trajectories(originals, path) == 3
    assert sorted(os.listdir(tmp_path)) == [path.name]  # no temp file left behind
    if suffix == ".jsonl.gz":
        with gzip.open(path, "rt") as f:
            assert len(f.read().splitlines()) == 3
    records, s = load_trajectories(path, VOCAB)
    assert s.accepted == 3 and s.quarantined == 0
    for r, o in zip(records, originals):
        assert (r.session_id, r.request_id, r.parent_request_id) == (o["session_id"], o["request_id"], o.get("parent_request_id"))
        assert r.input_ids.tolist() == o["input_ids"] and r.output_ids.tolist() == o["output_ids"]
        assert r.metadata == (o.get("metadata") or {})
    assert records[2].timestamp == pytest.approx(1748759400.0)
    # Records written back out again are identical (writer accepts TrajectoryRecord too).
    again = tmp_path / "again" / f"t{suffix}"
    write_trajectories(records, again)
    records2, _ = load_trajectories(again, VOCAB)
    assert [r.to_json_dict() for r in records2] == [r.to_json_dict() for r in records]


def test_writer_refuses_invalid_records_and_leaves_no_partial_file(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    write_trajectories([rec(0)], path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="non_integer_id"):
        write_trajectories([rec(1), rec(2, input_ids=[1.5])], path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["t.jsonl.gz"]
    with pytest.raises(ValueError, match="format"):
        write_trajectories([rec(0)], tmp_path / "t.csv")


def test_validate_record_direct():
    r = validate_record(rec(0), VOCAB, source="x.jsonl:7")
    assert r.num_tokens == 5 + 3 and not r.input_ids.flags.writeable
    with pytest.raises(InvalidRecord) as e:
        validate_record(rec(0, output_ids=[VOCAB]), VOCAB, source="x.jsonl:7")
    assert e.value.reason == "out_of_vocab" and "x.jsonl:7 request_id='s0-r0'" in str(e.value)


def test_missing_path_and_bad_vocab_raise(tmp_path):
    with pytest.raises(FileNotFoundError):
        TrajectoryReader([tmp_path / "nope.jsonl"], VOCAB)
    with pytest.raises(ValueError):
        TrajectoryReader([tmp_path], 0)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_no_line_can_stop_the_reader(tmp_path, make_hostile_lines, suffix):
    limit = 64 << 10
    hostile = make_hostile_lines(60, seed=14, max_record_bytes=limit)
    good = [json.dumps(rec(i, f"good{i % 7}")).encode() for i in range(60)]
    rng = np.random.default_rng(14)
    order = rng.permutation([("good", i) for i in range(60)] + [("hostile", i) for i in range(60)])
    lines = [good[int(i)] if kind == "good" else hostile[int(i)] for kind, i in order]
    path = tmp_path / f"mixed{suffix}"
    with (gzip.open if suffix.endswith(".gz") else open)(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    qpath = tmp_path / "q.jsonl"
    reader = TrajectoryReader(path, VOCAB, quarantine_path=qpath, max_record_bytes=limit)
    records = list(reader)
    s = reader.summary.check()
    assert s.accepted + s.quarantined == s.read == 120 and s.complete
    assert sorted(r.request_id for r in records) == sorted(json.loads(g)["request_id"] for g in good)
    items = [json.loads(line) for line in qpath.read_text().splitlines()]
    hostile_lines = [n + 1 for n, (kind, _) in enumerate(order) if kind == "hostile"]
    assert [it["line"] for it in items] == hostile_lines
    assert all(it["source_file"] == str(path) and it["reason"] in REASONS for it in items)
    for reason in ("number_too_large", "nesting_too_deep", "record_too_large", "malformed_json", "wrong_type"):
        assert s.by_reason[reason] >= 1, s.by_reason
    big = next(it for it in items if it["reason"] == "record_too_large")
    assert f"{path}:{big['line']}" in big["message"] and str(limit) in big["message"]
