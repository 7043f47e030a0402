"""The log tap under load on loopback: requests per second, peak RSS, records logged.

    python -m bench.bench_log_tap [--concurrency 200 --rounds 3]

Starts tests/fake_upstream.py (vLLM's answer format, 4 tokens an answer) and `dflash-pipeline tap` as
processes, fires `concurrency` requests at once (half streamed, half chat) `rounds` times through the tap,
then the same straight to the upstream, side by side. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str) -> None:
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def fire(url: str, concurrency: int, rounds: int) -> tuple[float, int]:
    import httpx

    ok = 0
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        for r in range(rounds):
            async def one(i):
                chat = i % 4 < 2
                body = {"model": "fake", "max_tokens": 16, "stream": i % 2 == 0,
                        **({"messages": [{"role": "user", "content": f"r{r} q{i}"}]} if chat else {"prompt": f"r{r} q{i}"})}
                response = await client.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body)
                return response.status_code == 200
            ok += sum(await asyncio.gather(*(one(i) for i in range(concurrency))))
    return time.perf_counter() - started, ok


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        up_port, tap_port = free_port(), free_port()
        upstream = subprocess.Popen([sys.executable, str(REPO / "tests" / "fake_upstream.py"), str(up_port)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tap = subprocess.Popen([sys.executable, "-m", "scripts.cli", "tap", "--upstream", f"http://127.0.0.1:{up_port}",
                                "--out", tmp, "--port", str(tap_port)], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "tap.err", "w"))
        try:
            wait(f"http://127.0.0.1:{up_port}/v1/models")
            wait(f"http://127.0.0.1:{tap_port}/tap/health")
            direct_s, direct_ok = asyncio.run(fire(f"http://127.0.0.1:{up_port}", args.concurrency, args.rounds))
            tap_s, tap_ok = asyncio.run(fire(f"http://127.0.0.1:{tap_port}", args.concurrency, args.rounds))
            rss = next(int(line.split()[1]) for line in Path(f"/proc/{tap.pid}/status").read_text().splitlines()
                       if line.startswith("VmHWM"))
            health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{tap_port}/tap/health").read())
        except Exception:
            print((Path(tmp) / "tap.err").read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            tap.terminate()
            tap.wait(timeout=60)
            upstream.terminate()
            upstream.wait(timeout=30)
        total = args.concurrency * args.rounds
        result = {"requests": total, "concurrency": args.concurrency,
                  "direct": {"ok": direct_ok, "seconds": round(direct_s, 2), "requests_per_s": round(total / direct_s, 1)},
                  "tap": {"ok": tap_ok, "seconds": round(tap_s, 2), "requests_per_s": round(total / tap_s, 1),
                          "records": health["records"], "peak_rss_mib": round(rss / 1024, 1)}}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
