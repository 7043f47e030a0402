"""The log tap in front of production traffic, black box: real processes on loopback, a small upstream that
answers like vLLM or SGLang (tests/fake_upstream.py), real signals. The real-engine load test is in
tests/test_engine_server.py."""

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import _free_port, wait_for_http
from data.trajectory.reader import load_trajectories

REPO = Path(__file__).resolve().parents[1]
ANSWER = [10, 11, 12, 2]


def _ids(text: str) -> list[int]:
    return [ord(c) % 1000 + 3 for c in text[:64]] or [3]


@pytest.fixture(params=["vllm", "sglang"])
def upstream(request, tmp_path):
    yield from _upstream(request.param)


@pytest.fixture
def vllm_upstream():
    """The engine-independent behaviours (signals, rotation, quota, quarantine) need one kind only."""
    yield from _upstream("vllm")


def _upstream(kind: str):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "fake_upstream.py"), str(port), kind],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_for_http(f"{url}/v1/models", proc)
    yield kind, url
    proc.terminate()
    proc.wait(timeout=30)


def _body(i: int, stream: bool, chat: bool, text: str | None = None, **extra) -> dict:
    text = text or f"request {i}: write a function"
    body = {"model": "fake", "max_tokens": 16, "stream": stream, **extra}
    body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    return body


async def _fire(url: str, bodies: list[dict], headers: list[dict] | None = None) -> list:
    """Every body at once; (status, text or the exception) per request."""
    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(i, body):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            try:
                response = await client.post(url + path, json=body, headers=(headers or [{}] * len(bodies))[i])
                return response.status_code, response.text
            except httpx.HTTPError as err:
                return None, err
        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


def _logged(out: Path, tmp_path: Path):
    records, summary = load_trajectories(out, 49_152, quarantine_path=tmp_path / "reader-quarantine.jsonl")
    return records, summary


def _tap_quarantine(out: Path) -> list[dict]:
    path = out / "tap-quarantine.ndjson"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _stop(proc, sig=signal.SIGTERM) -> None:
    proc.send_signal(sig)
    proc.wait(timeout=90)


def test_200_concurrent_requests_are_answered_and_logged_exactly_once(upstream, start_tap, tmp_path):
    kind, upstream_url = upstream
    out = tmp_path / "logs"
    url, tap = start_tap(upstream_url, out, "--upstream-kind", kind)
    # SGLang's chat stream carries no token ids: those requests are answered and counted, not logged.
    bodies = [_body(i, stream=i % 2 == 0, chat=i % 4 < 2, **({"return_token_ids": True} if i % 10 == 0 else {}))
              for i in range(200)]
    results = asyncio.run(_fire(url, bodies, [{"Authorization": "Bearer sk-SECRET-123"}] * 200))
    assert [status for status, _ in results] == [200] * 200, [r for r in results if r[0] != 200][:3]
    for body, (_, text) in zip(bodies, results):
        if body["stream"]:
            assert text.rstrip().endswith("data: [DONE]")
        if not body.get("return_token_ids"):
            assert "token_ids" not in text  # the client sees what the engine would have sent it
    peak_rss = int(next(line.split()[1] for line in Path(f"/proc/{tap.pid}/status").read_text().splitlines()
                        if line.startswith("VmHWM")))
    health = httpx.get(f"{url}/tap/health").json()
    _stop(tap)

    unloggable = [b for b in bodies if kind == "sglang" and b["stream"] and "messages" in b]
    records, summary = _logged(out, tmp_path)
    assert summary.quarantined == 0 and len(records) == 200 - len(unloggable)
    assert len({r.request_id for r in records}) == len(records)
    prompts = sorted(tuple(r.input_ids) for r in records)
    assert prompts == sorted(tuple(_ids(prompt)) for prompt in
                             (b.get("prompt") or b["messages"][0]["content"] for b in bodies if b not in unloggable))
    assert all(list(r.output_ids) == ANSWER and r.metadata["finish_reason"] == "stop" for r in records)
    assert health["answered"] == 200 and health["records"] == len(records)
    assert sum(health["quarantined"].values()) == len(unloggable)
    assert {q["reason"] for q in _tap_quarantine(out)} <= {"no_token_ids"}
    assert not any("SECRET" in p.read_text() for p in out.iterdir())  # no header is ever logged
    assert not list(out.glob("*.open"))  # closed on SIGTERM
    assert peak_rss < 500 * 1024, f"tap peak RSS {peak_rss} KiB"


def test_bad_requests_and_a_failing_upstream_get_proper_replies(upstream, start_tap, tmp_path):
    kind, upstream_url = upstream
    url, tap = start_tap(upstream_url, tmp_path / "logs", "--upstream-kind", kind, "--max-body-bytes", "2000",
                         "--timeout", "0.5")
    post = lambda content, path="/v1/completions": httpx.post(url + path, content=content, timeout=30)  # noqa: E731
    assert post(b'{"prompt": "unclosed').status_code == 400
    assert post(b'[{"prompt": "a list"}]').status_code == 400
    assert post(b'{"prompt": "\xff\xfe"}').status_code == 400
    too_big = post(json.dumps({"prompt": "x" * 5000}).encode())
    assert too_big.status_code == 413 and "limit" in too_big.json()["error"]["message"]
    assert post(json.dumps(_body(0, False, False, "SLOW please")).encode()).status_code == 504
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "fake"  # other paths pass through

    dead_url, _ = start_tap(f"http://127.0.0.1:{_free_port()}", tmp_path / "dead")
    dead = httpx.post(f"{dead_url}/v1/completions", json=_body(0, False, False), timeout=30)
    assert dead.status_code == 502 and "unreachable" in dead.json()["error"]["message"]


def test_a_stream_cut_by_the_upstream_is_aborted_and_never_logged(upstream, start_tap, tmp_path):
    kind, upstream_url = upstream
    out = tmp_path / "logs"
    url, tap = start_tap(upstream_url, out, "--upstream-kind", kind)
    with pytest.raises(httpx.HTTPError):  # not a cleanly ended 200 stream
        with httpx.stream("POST", f"{url}/v1/completions", json=_body(0, True, False, "DIE now"), timeout=30) as r:
            for _ in r.iter_lines():
                pass
    ok = httpx.post(f"{url}/v1/completions", json=_body(1, True, False), timeout=30)
    assert ok.status_code == 200
    _stop(tap)
    records, _ = _logged(out, tmp_path)
    assert [list(r.output_ids) for r in records] == [ANSWER]  # the cut stream ([10, 11]) is not a record
    assert "truncated_stream" in {q["reason"] for q in _tap_quarantine(out)}


def test_empty_answers_are_quarantined_and_never_block_later_records(vllm_upstream, start_tap, tmp_path):
    kind, upstream_url = vllm_upstream
    out = tmp_path / "logs"
    url, tap = start_tap(upstream_url, out, "--upstream-kind", kind, "--segment-records", "3")
    bodies = [_body(i, stream=i % 2 == 1, chat=False, text="EMPTY" if i < 4 else None) for i in range(12)]
    results = asyncio.run(_fire(url, bodies))
    assert [s for s, _ in results] == [200] * 12
    _stop(tap)
    records, summary = _logged(out, tmp_path)
    assert len(records) == 8 and summary.quarantined == 0
    assert len(list(out.glob("tap-*-*.jsonl"))) == 3  # rotated every 3 records, all closed
    assert sorted(q["reason"] for q in _tap_quarantine(out)) == ["empty_output"] * 2 + ["incomplete_stream"] * 2


def test_reused_request_id_headers_still_give_unique_records(vllm_upstream, start_tap, tmp_path):
    kind, upstream_url = vllm_upstream
    out = tmp_path / "logs"
    url, tap = start_tap(upstream_url, out, "--upstream-kind", kind)
    results = asyncio.run(_fire(url, [_body(i, False, False) for i in range(3)], [{"X-Request-Id": "same"}] * 3))
    assert [s for s, _ in results] == [200] * 3
    _stop(tap)
    records, summary = _logged(out, tmp_path)
    assert summary.accepted == 3 and len({r.request_id for r in records}) == 3
    assert {r.metadata["upstream_id"] for r in records} == {"cmpl-same"}


def test_sigterm_under_load_logs_every_answered_request(vllm_upstream, start_tap, tmp_path):
    kind, upstream_url = vllm_upstream
    out = tmp_path / "logs"
    url, tap = start_tap(upstream_url, out, "--upstream-kind", kind)

    async def load():
        task = asyncio.ensure_future(_fire(url, [_body(i, i % 2 == 0, False, f"SLOW {i}") for i in range(50)]))
        await asyncio.sleep(1.5)  # every request is in flight (the upstream holds each for 3 s)
        tap.send_signal(signal.SIGTERM)
        return await task

    results = asyncio.run(load())
    tap.wait(timeout=90)
    answered = [text for status, text in results if status == 200]
    assert len(answered) == 50  # graceful: the requests in flight finished
    records, summary = _logged(out, tmp_path)
    assert len(records) == 50 and summary.quarantined == 0


def test_sigkill_under_load_loses_at_most_the_requests_in_flight(vllm_upstream, start_tap, tmp_path):
    kind, upstream_url = vllm_upstream
    out = tmp_path / "logs"
    url, tap = start_tap(upstream_url, out, "--upstream-kind", kind)

    async def load():
        fast = await _fire(url, [_body(i, i % 2 == 0, False) for i in range(40)])
        slow = asyncio.ensure_future(_fire(url, [_body(i, False, False, f"SLOW {i}") for i in range(20)]))
        await asyncio.sleep(0.5)
        tap.send_signal(signal.SIGKILL)
        return fast, await slow

    fast, slow = asyncio.run(load())
    tap.wait(timeout=30)
    assert [s for s, _ in fast] == [200] * 40 and all(s is None for s, _ in slow)
    assert list(out.glob("*.jsonl.open"))  # left open by the kill
    url, tap = start_tap(upstream_url, out, "--upstream-kind", kind)  # a restart closes it, whole lines only
    _stop(tap)
    records, summary = _logged(out, tmp_path)
    assert summary.quarantined == 0 and len(records) == 40  # every answered request; none of those in flight
    assert not list(out.glob("*.open"))


def test_retention_and_quota_delete_the_oldest_closed_logs(vllm_upstream, start_tap, tmp_path):
    kind, upstream_url = vllm_upstream
    out = tmp_path / "logs"
    url, tap = start_tap(upstream_url, out, "--upstream-kind", kind, "--segment-records", "2", "--quota-gb", "0.0000015")
    assert [s for s, _ in asyncio.run(_fire(url, [_body(i, False, False) for i in range(12)]))] == [200] * 12
    health = httpx.get(f"{url}/tap/health").json()
    _stop(tap)
    closed = list(out.glob("tap-*-*.jsonl"))
    assert health["records"] == 12 and 0 < len(closed) < 6  # 6 segments were closed; the oldest went
    assert sum(p.stat().st_size for p in closed) <= 1500 + max(p.stat().st_size for p in closed)
