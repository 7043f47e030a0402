"""Training runs as the tests start them: a child process with one thread, and the weights a run ended with."""

import os
import subprocess
from pathlib import Path

from safetensors.torch import load_file

from drafters.drafter.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[1]


def run_quietly(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def final_weights(out: Path) -> dict:
    """The drafter weights of the run's newest checkpoint."""
    return load_file(str(list_checkpoints(out)[-1] / "drafter" / "model.safetensors"))
