"""Production log tap: a thin proxy in front of an OpenAI-compatible vLLM server that writes its traffic as
token-id trajectory logs (data/TRAJECTORY_FORMAT.md), exactly as the engine tokenized it.

    python -m data.log_tap --upstream http://127.0.0.1:8000 --port 8100 --out logs/ [--flush-every 64]

Clients talk to the proxy as they would to the server. For ``/v1/chat/completions`` and
``/v1/completions`` the proxy adds ``return_token_ids: true`` to the request, so vLLM answers with the
prompt's token ids as its chat template and tokenizer produced them (``prompt_token_ids``) and the
generated ids (``token_ids`` per choice, the stop token included): no detokenize / retokenize round trip.
One record per choice (``request_id`` = the response id, ``/i`` for choice i > 0). The session is the
``X-Session-Id`` header, else the request's ``user`` field, else the request is its own session; the
previous request of the same session is the ``parent_request_id``. Streaming responses are passed through
chunk by chunk and logged from their token-id deltas. Other paths (``/v1/models``, ``/metrics``,
``/health``) are forwarded unchanged. The ids are removed from the answer when the client did not ask
for them, so it sees exactly what the server would have sent.

Records are written with `data.trajectories.write_trajectories` (temp file, fsync, rename): one new
``tap-<start>-<n>.jsonl`` every ``flush_every`` records and on shutdown, never an append to a file a
reader may hold. The folder then feeds stage 2 (``data.trajectories``) and ``scripts/retrain.py``
(``retrain.incoming``) unchanged.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from data.trajectories import write_trajectories

LOGGED_PATHS = ("/v1/chat/completions", "/v1/completions")
SESSION_HEADER = "X-Session-Id"


class TrajectoryTap:
    """Collects records and writes them as rotated, atomically written JSONL files."""

    def __init__(self, out_dir: str | Path, flush_every: int = 64, model_name: str | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        self.model_name = model_name
        self.started = time.strftime("%Y%m%dT%H%M%S")
        self._lock = threading.Lock()
        self._pending: list[dict] = []
        self._last_in_session: dict[str, str] = {}
        self._files = 0
        self.written = 0

    def add(self, session_id: str, response_id: str, prompt_ids: list[int], choices: list[tuple[int, list[int], str | None]],
            arrived: float, metadata: dict) -> list[dict]:
        """One record per (index, output ids, finish reason) choice; returns them."""
        records = []
        with self._lock:
            parent = self._last_in_session.get(session_id)
            for index, output_ids, finish in sorted(choices):
                records.append({
                    "session_id": session_id, "request_id": response_id if index == 0 else f"{response_id}/{index}",
                    "parent_request_id": parent, "timestamp": arrived,
                    "input_ids": [int(i) for i in prompt_ids], "output_ids": [int(i) for i in output_ids],
                    "metadata": {**metadata, "finish_reason": finish, "source": "data.log_tap"}})
            self._last_in_session[session_id] = response_id
            self._pending.extend(records)
            if len(self._pending) >= self.flush_every:
                self._flush_locked()
        return records

    def _flush_locked(self) -> Path | None:
        if not self._pending:
            return None
        path = self.out_dir / f"tap-{self.started}-{self._files:06d}.jsonl"
        write_trajectories(self._pending, path)
        self._files += 1
        self.written += len(self._pending)
        self._pending = []
        return path

    def flush(self) -> Path | None:
        with self._lock:
            return self._flush_locked()


def _record_metadata(body: dict) -> dict:
    keys = ("model", "temperature", "top_p", "max_tokens", "max_completion_tokens")
    return {k: body[k] for k in keys if k in body}


def _session_of(headers, body: dict, response_id: str) -> str:
    return headers.get(SESSION_HEADER) or (body.get("user") if isinstance(body.get("user"), str) and body["user"] else None) \
        or f"request-{response_id}"


class TapHandler(BaseHTTPRequestHandler):
    """Forwards every request to `upstream`; logs the token ids of completions into `tap`. make_handler binds
    both (http.server builds a handler per request from its class)."""

    protocol_version = "HTTP/1.1"
    upstream = ""
    tap: TrajectoryTap | None = None
    upstream_timeout = 600.0

    def log_message(self, fmt, *args):  # one line per request on stderr is noise for a proxy
        pass

    def _forward(self, method: str, body: bytes | None):
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "content-length", "connection", "accept-encoding")}
        request = urllib.request.Request(self.upstream + self.path, data=body, method=method, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=self.upstream_timeout)
        except urllib.error.HTTPError as err:
            return err

    def _reply(self, status: int, headers, payload: bytes):
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        with self._forward("GET", None) as response:
            self._reply(response.status, response.headers.items(), response.read())

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        if path not in LOGGED_PATHS:
            with self._forward("POST", raw) as response:
                self._reply(response.status, response.headers.items(), response.read())
            return
        arrived = time.time()
        body = json.loads(raw or b"{}")
        asked_ids = bool(body.get("return_token_ids"))
        body["return_token_ids"] = True
        with self._forward("POST", json.dumps(body).encode()) as response:
            if response.status != 200:
                self._reply(response.status, response.headers.items(), response.read())
                return
            if body.get("stream"):
                self._stream(response, body, asked_ids, arrived)
                return
            answer = json.loads(response.read())
            self._log(body, answer.get("id", ""), answer.get("prompt_token_ids"),
                      [(c.get("index", 0), c.get("token_ids"), c.get("finish_reason")) for c in answer["choices"]],
                      arrived)
            if not asked_ids:
                answer.pop("prompt_token_ids", None)
                for choice in answer["choices"]:
                    choice.pop("token_ids", None)
            self._reply(200, response.headers.items(), json.dumps(answer).encode())

    def _stream(self, response, body: dict, asked_ids: bool, arrived: float):
        self.send_response(200)
        for k, v in response.headers.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        response_id, prompt_ids = "", None
        outputs: dict[int, list[int]] = {}
        finish: dict[int, str | None] = {}
        for line in response:
            text = line.decode().strip()
            if text.startswith("data: ") and text != "data: [DONE]":
                chunk = json.loads(text[6:])
                response_id = chunk.get("id", response_id)
                prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
                for choice in chunk.get("choices", []):
                    i = choice.get("index", 0)
                    outputs.setdefault(i, []).extend(choice.get("token_ids") or [])
                    finish[i] = choice.get("finish_reason") or finish.get(i)
                if not asked_ids:
                    chunk.pop("prompt_token_ids", None)
                    for choice in chunk.get("choices", []):
                        choice.pop("token_ids", None)
                    line = f"data: {json.dumps(chunk)}\n".encode()
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")
        self._log(body, response_id, prompt_ids, [(i, ids, finish.get(i)) for i, ids in outputs.items()], arrived)

    def _log(self, body: dict, response_id: str, prompt_ids, choices, arrived: float):
        if prompt_ids is None or any(ids is None for _, ids, _ in choices):
            raise RuntimeError(f"{self.upstream} returned no token ids for {self.path} (vLLM without return_token_ids?)")
        self.tap.add(_session_of(self.headers, body, response_id), response_id, prompt_ids, choices, arrived,
                     _record_metadata(body))


def make_handler(upstream: str, tap: TrajectoryTap, timeout: float = 600.0) -> type[TapHandler]:
    return type("BoundTapHandler", (TapHandler,), {"upstream": upstream.rstrip("/"), "tap": tap, "upstream_timeout": timeout})


class LogTapProxy:
    """The proxy server on a background thread (`start`/`stop`), or in the foreground (`serve_forever`)."""

    def __init__(self, upstream: str, out_dir: str | Path, host: str = "127.0.0.1", port: int = 0,
                 flush_every: int = 64):
        self.tap = TrajectoryTap(out_dir, flush_every)
        self.server = ThreadingHTTPServer((host, port), make_handler(upstream, self.tap))
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> "LogTapProxy":
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.tap.flush()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.log_tap", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="the vLLM server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--out", required=True, help="folder for the trajectory logs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--flush-every", type=int, default=64, help="records per written file")
    args = parser.parse_args(argv)
    proxy = LogTapProxy(args.upstream, args.out, args.host, args.port, args.flush_every)
    print(f"[log-tap] {proxy.url} -> {args.upstream}; logs under {args.out}", flush=True)
    try:
        proxy.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.server.server_close()
        proxy.tap.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
