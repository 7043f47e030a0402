"""Training checkpoints: atomic, keep-last-N, full resume.

Layout of one checkpoint, `<output_dir>/checkpoints/step-000120/`:
  state/            accelerate's save_state: model, optimizer, scheduler, RNG (DeepSpeed-aware)
  drafter/          the drafter in the serving format (what eval, export, SGLang and vLLM load)
  trainer_state.json  step, epoch, position in the epoch, metrics
Each is written under a temporary name and renamed into place, so a killed job never leaves a
half-written checkpoint under a real name; the newest complete one is what a resume picks up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d{6,})$")


@dataclass
class TrainerState:
    step: int = 0              # optimizer steps taken
    epoch: int = 0             # current epoch
    batch_in_epoch: int = 0    # micro-batches of this epoch already consumed
    elapsed_seconds: float = 0.0  # wall time of the run so far, data and feature preparation included
    metrics: dict = field(default_factory=dict)


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    folder = checkpoints_dir(output_dir)
    if not folder.exists():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def read_trainer_state(checkpoint: Path) -> TrainerState:
    return TrainerState(**json.loads((checkpoint / "trainer_state.json").read_text()))


def save_checkpoint(accelerator, output_dir: str | Path, state: TrainerState, save_drafter, keep_last: int) -> Path:
    """Collective: every process calls it. save_drafter(path) writes the serving-format drafter."""
    folder = checkpoints_dir(output_dir)
    final = folder / f"step-{state.step:06d}"
    tmp = folder / f".tmp-step-{state.step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"))
    save_drafter(tmp / "drafter")  # gathers weights on every process, writes on the main one
    accelerator.wait_for_everyone()  # every rank's part of state/ is on disk before the rename
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final
