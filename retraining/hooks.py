"""Telling the engine: `retrain.on_promote` runs after a version becomes current (bootstrap, promotion,
rollback), so the server serves what `current` names without anyone reloading it by hand.

The hook is either a command (a string, split like a shell would, or a list of arguments) or an
`http://` / `https://` URL. A command's arguments may name `{event}` (bootstrap, promote, rollback),
`{version}`, `{drafter}` (the version's drafter folder), `{bf16}` and `{fp8}` (its exports, "" when not
exported); it also gets them as DFLASH_EVENT, DFLASH_VERSION, DFLASH_DRAFTER, DFLASH_BF16, DFLASH_FP8.
A URL gets them as a JSON POST. The hook runs after the state is committed: a failed hook leaves the new
version current and the exit status 4, so that the scheduler retries the notification, not the cycle
(`scripts/retrain.py --notify` runs the hook again for the current version).

Testbed: `dflash-pipeline serve restart` restarts a vLLM server with the promoted drafter. On GPUs a
rolling restart of the replicas does the same; SGLang can also swap weights in place through its
`/update_weights_from_disk` endpoint (for the draft model where the installed version supports it).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from retraining.state import RetrainError


class HookFailed(RetrainError):
    """The new version is current, but the engine was not told (exit status 4)."""


def hook_values(event: str, version: str, version_dir: Path) -> dict:
    """Paths inside the version's folder as it is now (a state dir moved or restored from a backup keeps working)."""
    exports = json.loads((version_dir / "version.json").read_text()).get("exports") or {}
    return {"event": event, "version": version, "drafter": str(version_dir / "drafter"),
            **{dtype: str(version_dir / dtype) if dtype in exports else "" for dtype in ("bf16", "fp8")}}


def notify_engine(hook, event: str, version: str, version_dir: Path, timeout: float, log=print) -> dict | None:
    """Run the hook for this event; returns what it did, or raises HookFailed."""
    if not hook:
        return None
    values = hook_values(event, version, version_dir)
    if isinstance(hook, str) and hook.startswith(("http://", "https://")):
        request = urllib.request.Request(hook, data=json.dumps(values).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status = response.status
        except (urllib.error.URLError, OSError) as err:
            raise HookFailed(f"{event} of {version} is committed, but retrain.on_promote ({hook}) failed: {err}. "
                             "Run `scripts/retrain.py --notify` once the endpoint is back") from None
        log(f"[retrain] on_promote: POST {hook} -> {status}")
        return {"hook": hook, "status": status}
    argv = shlex.split(hook) if isinstance(hook, str) else list(hook)
    argv = [part.format(**values) for part in argv]
    env = {**os.environ, **{f"DFLASH_{key.upper()}": value for key, value in values.items()}}
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise HookFailed(f"{event} of {version} is committed, but retrain.on_promote {argv} failed: {err}") from None
    if done.returncode != 0:
        raise HookFailed(f"{event} of {version} is committed, but retrain.on_promote {argv} exited "
                         f"{done.returncode}: {done.stderr.strip()[-500:]}")
    log(f"[retrain] on_promote: {' '.join(argv)} (exit 0)")
    return {"hook": argv, "status": 0}
