"""GPU-only: serve an FP8 (or bf16) export with SGLang and print the acceptance length it measures.

    dflash-pipeline sglang-check --target TARGET --export EXPORT [--prompts 8] [--max-new-tokens 256]

Starts ``python -m sglang.launch_server`` with the export as the DFLASH draft model (the command the
export's model card prints), sends a few chat prompts greedily and prints one JSON line: tau =
completion tokens / verification steps (``meta_info.spec_verify_ct``), per prompt and pooled. SGLang
is GPU-only, so this script never imports it: it talks to the server process over HTTP. Not run by the
tests (this machine has no GPU); keep the export contract (drafters/export/contract.py) and run this where a
GPU is available.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request

PROMPTS = ["Write a Python function that merges two sorted lists.", "Explain how a hash map works.",
           "Write a bash one-liner that counts lines in all .py files.", "Why is the sky blue?",
           "Implement binary search in C.", "Summarise the causes of the French Revolution.",
           "Write a SQL query for the top 5 customers by revenue.", "What does a Python decorator do?"]


def post_json(url: str, payload: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class SGLangCheckError(RuntimeError):
    """The server could not be started or did not come up."""


def sglang_tau(target: str, export: str, prompts: int = 8, max_new_tokens: int = 256, tp: int = 1,
               startup_timeout: float = 1800) -> dict:
    """Serve `export` as the DFLASH draft model of `target` with SGLang, decode `prompts` chat prompts greedily
    and return tau per prompt and pooled."""
    if importlib.util.find_spec("sglang") is None:
        raise SGLangCheckError("SGLang is not installed (pip install -e .[sglang], on a GPU machine)")
    block = json.loads(open(f"{export}/config.json").read())["block_size"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", target,
                               "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", export,
                               "--speculative-num-draft-tokens", str(block), "--tp-size", str(tp),
                               "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + startup_timeout
        while True:
            if server.poll() is not None:
                raise SGLangCheckError(f"sglang.launch_server exited with {server.returncode}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise SGLangCheckError("the SGLang server did not come up") from None
                time.sleep(5)
        rows = []
        for prompt in (PROMPTS * (1 + prompts // len(PROMPTS)))[:prompts]:
            out = post_json(f"{url}/generate", {"text": prompt, "sampling_params": {
                "temperature": 0, "max_new_tokens": max_new_tokens}})
            meta = out.get("meta_info", {})
            tokens, steps = meta.get("completion_tokens", 0), meta.get("spec_verify_ct", 0)
            rows.append({"prompt": prompt[:40], "completion_tokens": tokens, "verify_steps": steps,
                         "tau": tokens / steps if steps else None})
        tokens, steps = sum(r["completion_tokens"] for r in rows), sum(r["verify_steps"] for r in rows)
        return {"backend": "sglang", "export": export, "target": target,
                "tau": tokens / steps if steps else None, "prompts": rows}
    finally:
        server.terminate()
        server.wait(timeout=120)
