"""The simulator's sessions as clients of a server: each assistant turn is a request to an OpenAI-compatible
`/v1/completions` endpoint (a vLLM server, or the log tap in front of one), token ids in and out.

The agents' state machine (simulator/agents.py) is unchanged: a round's requests are sent concurrently (the
server batches them), each prompt as the token ids the session built, with the session's id in `X-Session-Id`
(what the log tap groups sessions by). The server's own output ids come back through `return_token_ids`.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from simulator.agents import cut_at_eos

SESSION_HEADER = "X-Session-Id"


class ServerError(RuntimeError):
    """The server refused or failed a simulated request (the message names the URL and the session)."""


def served_model(url: str, timeout: float = 30.0) -> str:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (OSError, KeyError, IndexError, json.JSONDecodeError) as err:
        raise ServerError(f"{url}/v1/models: {err}") from None


class ServerGenerator:
    """`simulator.agents.TargetGenerator`'s interface over a server: generated ids (cut at the first stop id,
    which is kept), whether the turn ended, and the counts the summary reports."""

    def __init__(self, url: str, eos_ids: list[int], temperature: float, seed: int, timeout: float = 900.0):
        self.url = url.rstrip("/")
        self.model = served_model(self.url)
        self.eos_ids = list(eos_ids)
        self.eos_set = set(self.eos_ids)
        self.temperature, self.seed, self.timeout = float(temperature), seed, timeout
        self.generated = 0
        self.prefill = 0
        self.requests = 0
        self._seconds = 0.0

    @property
    def seconds(self) -> float:
        return self._seconds

    def _one(self, prompt: list[int], limit: int, key: str) -> list[int]:
        session = key.rsplit("/", 1)[0]  # keys are "<session id>/r<turn>"
        body = {"model": self.model, "prompt": [int(t) for t in prompt], "max_tokens": int(limit),
                "temperature": self.temperature, "stop_token_ids": self.eos_ids, "return_token_ids": True,
                "skip_special_tokens": False}
        if self.temperature > 0:
            body["seed"] = self.seed
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", SESSION_HEADER: session})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise ServerError(f"{self.url}/v1/completions answered {err.code} for session {session}: "
                              f"{err.read()[:500]!r}") from None
        except OSError as err:
            raise ServerError(f"{self.url}/v1/completions failed for session {session}: {err}") from None
        ids = (answer.get("choices") or [{}])[0].get("token_ids")
        if ids is None:
            raise ServerError(f"{self.url} returned no token_ids for session {session} (a vLLM server with "
                              "return_token_ids is needed)")
        return [int(t) for t in ids]

    def __call__(self, prompts: list[list[int]], limits: list[int], keys: list[str]) -> list[tuple[list[int], bool]]:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            rows = list(pool.map(self._one, prompts, limits, keys))
        self._seconds += time.perf_counter() - started
        results = []
        for row, limit in zip(rows, limits):
            gen, finished = cut_at_eos(row, limit, self.eos_set)
            results.append((gen, finished))
            self.generated += len(gen)
        self.prefill += sum(len(p) for p in prompts)
        self.requests += len(prompts)
        return results
