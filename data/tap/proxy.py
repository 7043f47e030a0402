"""Production log tap: an async proxy in front of an OpenAI-compatible vLLM or SGLang server that writes its
traffic as token-id trajectory logs (data/TRAJECTORY_FORMAT.md), exactly as the engine tokenized it.

    dflash-pipeline tap --upstream http://127.0.0.1:8000 --port 8100 --out logs/ [--upstream-kind sglang]

(the `tap` extra: starlette, uvicorn, httpx). Clients talk to the tap as they would to the server.

- `/v1/chat/completions` and `/v1/completions` get the engine's own token ids added to the request: vLLM
  `return_token_ids` (`prompt_token_ids` at the top level, `token_ids` per choice, streamed as deltas);
  SGLang `return_token_ids` and, for chat, `return_prompt_token_ids` (both per choice; SGLang's chat stream
  carries no ids at all). The ids are removed from the answer when the client did not ask for them, so it
  sees exactly what the server sent. Other paths are forwarded unchanged.
- One record per choice. `request_id` is the engine's response id (`/i` for choice i > 0), made unique when
  a client reuses `X-Request-Id` (which the engine then reuses) or the id was already logged; the engine's
  id stays in `metadata.upstream_id`. The session is `X-Session-Id`, else the request's `user`, else the
  request itself; the session's previous request is the `parent_request_id`. Headers are never logged.
- A record is written and fsync'd to the open segment (data/tap/segments.py) before the answer's last byte
  leaves the tap, so SIGTERM (graceful: in-flight requests finish) loses nothing answered and SIGKILL at most
  the requests in flight. A stream the upstream cut short is aborted towards the client and never logged.
  An answer without token ids, or a record that fails validation, is quarantined with its reason
  (`tap-quarantine.ndjson`); the client gets its answer either way.
- Bad requests get proper replies: 400 (not JSON, not an object, not UTF-8), 413 (over --max-body-bytes),
  502 (upstream unreachable or failed), 504 (upstream timeout). `GET /tap/health` reports the counters.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from data.tap.segments import SegmentLog

LOGGED_PATHS = ("/v1/chat/completions", "/v1/completions")
SESSION_HEADER = "x-session-id"
REQUEST_ID_HEADER = "x-request-id"
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-authenticate", "accept-encoding", "content-encoding"}
RECENT_IDS = 200_000  # request ids remembered for uniqueness (and sessions for parents): bounded memory


@dataclass
class TapSettings:
    upstream: str
    out_dir: str
    upstream_kind: str = "vllm"          # vllm or sglang: how to ask for and read token ids
    timeout: float = 600.0               # seconds to wait for the upstream (connect 10 s)
    max_body_bytes: int = 32 << 20
    max_connections: int = 1024          # to the upstream
    segment_records: int = 10_000
    segment_bytes: int = 256 << 20
    retention_days: float | None = None
    quota_gb: float | None = None


class _Recent(OrderedDict):
    """A bounded LRU map."""

    def remember(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > RECENT_IDS:
            self.popitem(last=False)


class Tap:
    """What the proxy logs: records built from token ids, made unique, written through the segment log."""

    def __init__(self, settings: TapSettings):
        self.settings = settings
        self.instance = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        self.log = SegmentLog(settings.out_dir, self.instance, max_records=settings.segment_records,
                              max_bytes=settings.segment_bytes,
                              retention_seconds=settings.retention_days * 86400 if settings.retention_days else None,
                              quota_bytes=int(settings.quota_gb * 1e9) if settings.quota_gb else None)
        self._ids, self._sessions = _Recent(), _Recent()
        self._sequence = 0
        self.answered = 0

    def unique_id(self, upstream_id: str, reused_header: bool) -> str:
        self._sequence += 1
        rid = upstream_id or f"tap-{self.instance}-{self._sequence}"
        if reused_header or rid in self._ids:
            rid = f"{rid}~{self.instance}-{self._sequence}"
        self._ids.remember(rid, True)
        return rid

    def records(self, headers, body: dict, upstream_id: str, prompt_ids, choices: list, arrived: float) -> list[dict]:
        """One record per (index, output ids, finish reason, choice prompt ids) choice."""
        rid = self.unique_id(str(upstream_id or ""), REQUEST_ID_HEADER in headers)
        user = body.get("user") if isinstance(body.get("user"), str) and body.get("user") else None
        session = headers.get(SESSION_HEADER) or user or f"request-{rid}"
        parent = self._sessions.get(session)
        self._sessions.remember(session, rid)
        metadata = {k: body[k] for k in ("model", "temperature", "top_p", "max_tokens", "max_completion_tokens") if k in body}
        out = []
        for index, output_ids, finish, choice_prompt in sorted(choices, key=lambda c: c[0]):
            out.append({"session_id": session, "request_id": rid if index == 0 else f"{rid}/{index}",
                        "parent_request_id": parent, "timestamp": arrived,
                        "input_ids": prompt_ids if prompt_ids is not None else choice_prompt, "output_ids": output_ids,
                        "metadata": {**metadata, "finish_reason": finish, "upstream_id": upstream_id,
                                     "source": "data.tap.proxy"}})
        return out

    def write(self, records: list[dict]) -> None:
        for record in records:
            if record["input_ids"] is None or record["output_ids"] is None:
                self.log.quarantine(record, "no_token_ids", f"the {self.settings.upstream_kind} upstream returned no "
                                    "token ids for this answer (the client got it)")
            else:
                self.log.append(record)


# --------------------------------------------------------------------------------------------------
# How each engine is asked for ids, and where they are in its answers
# --------------------------------------------------------------------------------------------------

ID_FLAGS = {"vllm": ("return_token_ids",), "sglang": ("return_token_ids", "return_prompt_token_ids")}
ID_FIELDS = ("prompt_token_ids", "token_ids")


def ask_for_ids(body: dict, kind: str, path: str) -> dict:
    """The body with the engine's token-id flags set; returns which flags the client had set itself."""
    asked = {flag: bool(body.get(flag)) for flag in ID_FLAGS[kind]}
    if kind == "sglang" and path == "/v1/chat/completions" and body.get("stream"):
        return asked  # SGLang's chat stream carries no ids and refuses these flags: the answer goes through unlogged
    for flag in ID_FLAGS[kind]:
        if kind == "sglang" and flag == "return_prompt_token_ids" and path != "/v1/chat/completions":
            continue  # SGLang's completions return the prompt's ids with return_token_ids
        body[flag] = True
    return asked


def strip_ids(payload: dict, asked: dict) -> None:
    """Remove the ids the client did not ask for (from the top level and from every choice)."""
    if any(asked.values()):
        return
    for field in ID_FIELDS:
        payload.pop(field, None)
        for choice in payload.get("choices") or []:
            if isinstance(choice, dict):
                choice.pop(field, None)


def answer_ids(answer: dict):
    """(response id, top-level prompt ids or None, [(index, output ids, finish reason, choice prompt ids)])."""
    choices = [(c.get("index", 0), c.get("token_ids"), c.get("finish_reason"), c.get("prompt_token_ids"))
               for c in answer.get("choices") or [] if isinstance(c, dict)]
    return answer.get("id", ""), answer.get("prompt_token_ids"), choices


class StreamIds:
    """Token ids gathered from a stream's chunks (vLLM and SGLang send deltas)."""

    def __init__(self):
        self.response_id, self.prompt_ids, self.done = "", None, False
        self.outputs: dict[int, list[int]] = {}
        self.finish: dict[int, str | None] = {}
        self.choice_prompts: dict[int, list[int]] = {}
        self.missing = False

    def add(self, chunk: dict) -> None:
        self.response_id = chunk.get("id") or self.response_id
        self.prompt_ids = chunk.get("prompt_token_ids") or self.prompt_ids
        for choice in chunk.get("choices") or []:
            i = choice.get("index", 0)
            ids = choice.get("token_ids")
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if ids is None and (delta.get("content") or choice.get("text")):
                self.missing = True  # content without ids (SGLang's chat stream); a role-only first chunk is fine
            self.outputs.setdefault(i, []).extend(ids or [])
            self.finish[i] = choice.get("finish_reason") or self.finish.get(i)
            if choice.get("prompt_token_ids"):
                self.choice_prompts[i] = choice["prompt_token_ids"]

    def complete(self) -> bool:
        """[DONE] seen and every choice finished: only such a stream is logged."""
        return self.done and bool(self.outputs) and all(self.finish.get(i) for i in self.outputs)

    def choices(self) -> list:
        return [(i, None if self.missing else ids, self.finish.get(i), self.choice_prompts.get(i))
                for i, ids in self.outputs.items()]


# --------------------------------------------------------------------------------------------------
# The ASGI app
# --------------------------------------------------------------------------------------------------

def create_app(settings: TapSettings):
    """The tap as a Starlette app (uvicorn serves it; tests may too)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    upstream = settings.upstream.rstrip("/")
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["tap"] = Tap(settings)
        state["client"] = httpx.AsyncClient(
            base_url=upstream, timeout=httpx.Timeout(settings.timeout, connect=10.0),
            # Idle connections are dropped before the engine's server drops them (vLLM's uvicorn: 5 s), so none is
            # reused in the instant the engine closes it.
            limits=httpx.Limits(max_connections=settings.max_connections, max_keepalive_connections=64,
                                keepalive_expiry=2.0))
        try:
            yield
        finally:
            await state["client"].aclose()
            state["tap"].log.close()

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "log_tap", "code": status}}, status_code=status)

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise _Refused(413, f"request body of {declared} bytes is over the tap's limit of {settings.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise _Refused(413, f"request body over the tap's limit of {settings.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def forward_headers(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}

    def reply_headers(response) -> dict:
        return {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}

    async def send(request: Request, body: bytes):
        client = state["client"]
        upstream_request = client.build_request(request.method, request.url.path, params=request.query_params,
                                                content=body, headers=forward_headers(request))
        try:
            return await client.send(upstream_request, stream=True)
        except httpx.TimeoutException as err:
            raise _Refused(504, f"the upstream {upstream} did not answer in time ({type(err).__name__})") from None
        except httpx.HTTPError as err:
            raise _Refused(502, f"the upstream {upstream} is unreachable ({type(err).__name__}: {err})") from None

    async def passthrough(response) -> StreamingResponse:
        async def body():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()
        return StreamingResponse(body(), status_code=response.status_code, headers=reply_headers(response))

    async def health(request: Request) -> JSONResponse:
        tap: Tap = state["tap"]
        return JSONResponse({"status": "ok", "upstream": upstream, "upstream_kind": settings.upstream_kind,
                             "answered": tap.answered, "records": tap.log.written,
                             "quarantined": dict(tap.log.quarantined),
                             "open_segment": str(tap.log.open_path) if tap.log.open_path else None})

    async def proxy(request: Request) -> Response:
        try:
            return await _proxy(request)
        except _Refused as refused:
            return error(refused.status, refused.message)
        except ClientDisconnect:
            return Response(status_code=499)

    async def _proxy(request: Request) -> Response:
        raw = await read_body(request)
        path = request.url.path
        if request.method != "POST" or path not in LOGGED_PATHS:
            return await passthrough(await send(request, raw))
        arrived = time.time()
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise _Refused(400, f"request body is not UTF-8 (byte {err.start})") from None
        except json.JSONDecodeError as err:
            raise _Refused(400, f"request body is not JSON ({err})") from None
        if not isinstance(body, dict):
            raise _Refused(400, f"request body must be a JSON object, got {type(body).__name__}")
        asked = ask_for_ids(body, settings.upstream_kind, path)
        response = await send(request, json.dumps(body).encode())
        if response.status_code != 200:
            return await passthrough(response)
        tap: Tap = state["tap"]
        if body.get("stream"):
            return StreamingResponse(_stream(tap, request, body, asked, response, arrived),
                                     status_code=200, headers=reply_headers(response))
        try:
            data = await response.aread()
        except httpx.HTTPError as err:
            raise _Refused(502, f"the upstream failed mid-answer ({type(err).__name__})") from None
        finally:
            await response.aclose()
        try:
            answer = json.loads(data)
        except json.JSONDecodeError:
            raise _Refused(502, "the upstream answered 200 with a body that is not JSON") from None
        upstream_id, prompt_ids, choices = answer_ids(answer)
        records = tap.records(request.headers, body, upstream_id, prompt_ids, choices, arrived)
        await run_in_threadpool(tap.write, records)
        tap.answered += 1
        strip_ids(answer, asked)
        headers = reply_headers(response)
        headers.pop("content-type", None)
        return JSONResponse(answer, headers=headers)

    async def _stream(tap: Tap, request: Request, body: dict, asked: dict, response, arrived: float):
        ids = StreamIds()
        try:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line.strip() != "data: [DONE]":
                    try:
                        chunk = json.loads(line[6:])
                    except json.JSONDecodeError:
                        chunk = None
                    if isinstance(chunk, dict):
                        ids.add(chunk)
                        strip_ids(chunk, asked)
                        line = "data: " + json.dumps(chunk)
                elif line.strip() == "data: [DONE]":
                    ids.done = True
                    # Logged before the client sees the end: an answered stream is a written record.
                    if ids.complete():
                        await run_in_threadpool(tap.write, tap.records(request.headers, body, ids.response_id,
                                                                       ids.prompt_ids, ids.choices(), arrived))
                    else:
                        tap.log.quarantine({"request_id": ids.response_id}, "incomplete_stream",
                                           "the stream ended without tokens or without a finish reason for every choice")
                    tap.answered += 1
                yield line + "\n"
        except httpx.HTTPError as err:
            # The upstream died mid-stream: never logged, and the client's stream is aborted, not ended cleanly.
            tap.log.quarantine({"request_id": ids.response_id}, "truncated_stream",
                               f"the upstream stream broke ({type(err).__name__}) after {sum(map(len, ids.outputs.values()))} tokens")
            raise
        finally:
            await response.aclose()
        if not ids.done:
            tap.log.quarantine({"request_id": ids.response_id}, "truncated_stream",
                               "the upstream ended the stream without [DONE]")
            raise RuntimeError("upstream stream ended without [DONE]")  # abort the client's stream

    routes = [Route("/tap/health", health, methods=["GET"]),
              Route("/{path:path}", proxy, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])]
    return Starlette(routes=routes, lifespan=lifespan)


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def serve_tap(settings: TapSettings, host: str, port: int, graceful_seconds: float = 60.0) -> None:
    """Run the tap until SIGTERM or SIGINT (which wait up to `graceful_seconds` for the requests in flight)."""
    try:
        import uvicorn  # the `tap` extra
    except ImportError as err:
        raise SystemExit(f"error: the log tap needs the `tap` extra (pip install -e .[tap]): {err}") from None
    # Idle keep-alive connections outlive the clients' own expiry (httpx 5 s, browsers 60 s), so a client never
    # reuses one in the instant the tap closes it (a reset the client would see).
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=graceful_seconds, timeout_keep_alive=75, backlog=2048)
