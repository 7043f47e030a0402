"""A small OpenAI-compatible upstream for the log tap's tests: vLLM's or SGLang's way of returning token ids,
and the failures a tap must survive. Run: python tests/fake_upstream.py PORT [vllm|sglang].

Prompt ids are the prompt's characters (ord % 1000 + 3); every answer is [10, 11, 12, 2] (2 = end of turn),
cut with finish_reason "length" below max_tokens 4. Prompts containing DIE break the stream after two
tokens, EMPTY answer with no tokens, SLOW wait 3 s first. The response id is `cmpl-<X-Request-Id>` when the
client sends one (as vLLM does), else a fresh one."""

import asyncio
import itertools
import json
import sys
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

KIND = sys.argv[2] if len(sys.argv) > 2 else "vllm"
ANSWER = [10, 11, 12, 2]
counter = itertools.count()


def prompt_text(body: dict) -> str:
    if "messages" in body:
        return "\n".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


async def completions(request):
    body = await request.json()
    chat = request.url.path.endswith("/chat/completions")
    text = prompt_text(body)
    prompt_ids = [ord(c) % 1000 + 3 for c in text[:64]] or [3]
    limit = int(body.get("max_tokens") or 16)
    output = [] if "EMPTY" in text else ANSWER[:limit]
    finish = "stop" if len(output) == len(ANSWER) or not output else "length"
    header = request.headers.get("x-request-id")
    rid = f"cmpl-{header}" if header else f"cmpl-{uuid.uuid4().hex[:12]}-{next(counter)}"
    if "SLOW" in text:
        await asyncio.sleep(3.0)
    ids = bool(body.get("return_token_ids"))
    prompt_ids_asked = ids if KIND == "vllm" else (body.get("return_prompt_token_ids") if chat else ids)
    if not body.get("stream"):
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": "x" * len(output)}} if chat else {"text": "x" * len(output)})
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "choices": [choice]}
        if ids:
            choice["token_ids"] = output
        if prompt_ids_asked:
            (answer if KIND == "vllm" else choice)["prompt_token_ids"] = prompt_ids
        return JSONResponse(answer)

    async def events():
        for k, token in enumerate(output):
            if "DIE" in text and k == 2:
                raise ConnectionResetError("the upstream died mid-stream")
            choice = {"index": 0, "finish_reason": finish if k == len(output) - 1 else None}
            choice.update({"delta": {"content": "x"}} if chat else {"text": "x"})
            if ids and not (KIND == "sglang" and chat):
                choice["token_ids"] = [token]
            chunk = {"id": rid, "choices": [choice]}
            if k == 0 and prompt_ids_asked and not (KIND == "sglang" and chat):
                (chunk if KIND == "vllm" else choice)["prompt_token_ids"] = prompt_ids
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(0.005)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "fake"}]})


app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/chat/completions", completions, methods=["POST"]),
                        Route("/v1/models", models, methods=["GET"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error", backlog=2048)
