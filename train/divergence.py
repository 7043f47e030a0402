"""Finite blow-ups: a run whose loss, gradient norm or weights climb far and stay there.

Non-finite losses are caught step by step in train/dflash.py; this catches what stays finite. A too-high
lr (train.lr=1e6 on the testbed) drives the weights' norm from 17.6 to 8.9e8 in 24 steps while the loss
stays level (the logits saturate) and the gradient goes to zero, so the weights' norm is watched as well
as the loss and the gradient norm. The loss and the gradient norm are smoothed (an exponential moving
average), because one hard batch is not a divergence: the run stops when a signal stays above `factor` x
its reference (the weights: their norm at the run's first step; the others: their lowest moving average
so far) for `patience` optimizer steps in a row.

A checkpoint written while the guard counts such steps is not "good"; `last_good_checkpoint` names the
newest one that is, `keep_last` never deletes it, and when the run stops the ones after it are moved to
`checkpoints/diverged/` so that a resume continues from it.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from drafters.drafter.checkpoint import TRAINER_STATE, checkpoints_dir, list_checkpoints

SMOOTHING = 0.9  # weight of the past in the moving averages: about 10 steps
DIVERGED_DIR = "diverged"


@dataclass
class GuardState:
    loss_avg: float | None = None
    loss_best: float | None = None
    grad_avg: float | None = None
    grad_best: float | None = None
    weight_start: float | None = None  # the weights' norm after the run's first step
    bad_steps: int = 0  # optimizer steps in a row above a threshold


class DivergenceGuard:
    def __init__(self, loss_factor: float | None, grad_norm_factor: float | None, weight_norm_factor: float | None,
                 patience: int, state: dict | None = None):
        self.loss_factor, self.grad_norm_factor, self.patience = loss_factor, grad_norm_factor, patience
        self.weight_norm_factor = weight_norm_factor
        self.state = GuardState(**(state or {}))

    @property
    def healthy(self) -> bool:
        """No step of the current run of climbing losses: a checkpoint written now is a good one."""
        return self.state.bad_steps == 0

    def update(self, loss: float, grad_norm: float | None, weight_norm: float) -> str | None:
        """One finite optimizer step's loss (mean over processes), pre-clip gradient norm and weights' norm;
        the reason to stop, or None."""
        s = self.state
        s.loss_avg = _smoothed(s.loss_avg, loss)
        s.loss_best = s.loss_avg if s.loss_best is None else min(s.loss_best, s.loss_avg)
        reasons = []
        if self.loss_factor is not None and s.loss_avg > self.loss_factor * s.loss_best:
            reasons.append(f"the loss (moving average {s.loss_avg:.4g}) above train.divergence_loss_factor="
                           f"{self.loss_factor:g} x its lowest, {s.loss_best:.4g}")
        if grad_norm is not None and math.isfinite(grad_norm):
            s.grad_avg = _smoothed(s.grad_avg, grad_norm)
            s.grad_best = s.grad_avg if s.grad_best is None else min(s.grad_best, s.grad_avg)
            if self.grad_norm_factor is not None and s.grad_avg > self.grad_norm_factor * s.grad_best:
                reasons.append(f"the gradient norm (moving average {s.grad_avg:.4g}) above "
                               f"train.divergence_grad_norm_factor={self.grad_norm_factor:g} x its lowest, {s.grad_best:.4g}")
        s.weight_start = weight_norm if s.weight_start is None else s.weight_start
        if self.weight_norm_factor is not None and weight_norm > self.weight_norm_factor * s.weight_start:
            reasons.append(f"the weights' norm ({weight_norm:.4g}) above train.divergence_weight_norm_factor="
                           f"{self.weight_norm_factor:g} x its value at the run's first step, {s.weight_start:.4g}")
        s.bad_steps = s.bad_steps + 1 if reasons else 0
        if s.bad_steps >= self.patience:
            return f"{' and '.join(reasons)} for {s.bad_steps} steps in a row (train.divergence_patience={self.patience})"
        return None

    def to_dict(self) -> dict:
        return asdict(self.state)


def _smoothed(average: float | None, value: float) -> float:
    return value if average is None else SMOOTHING * average + (1 - SMOOTHING) * value


def is_good(checkpoint: Path) -> bool:
    """Written while the run was healthy (checkpoints from before the guard existed count as good)."""
    return json.loads((checkpoint / TRAINER_STATE).read_text()).get("healthy", True)


def last_good_checkpoint(output_dir: str | Path) -> Path | None:
    good = [c for c in list_checkpoints(output_dir) if is_good(c)]
    return good[-1] if good else None


def prunable(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Checkpoints past the newest keep_last, except the last good one."""
    keep = last_good_checkpoint(output_dir)
    return [c for c in list_checkpoints(output_dir)[:-keep_last] if c != keep]


def set_aside_after(output_dir: str | Path, good: Path | None) -> list[Path]:
    """Move the checkpoints newer than `good` (all of them when None) to checkpoints/diverged/; returns their new paths."""
    folder = checkpoints_dir(output_dir) / DIVERGED_DIR
    checkpoints = list_checkpoints(output_dir)
    after = checkpoints[checkpoints.index(good) + 1:] if good is not None else checkpoints
    moved = []
    for checkpoint in after:
        folder.mkdir(exist_ok=True)
        destination = folder / checkpoint.name
        shutil.rmtree(destination, ignore_errors=True)
        moved.append(Path(shutil.move(str(checkpoint), str(destination))))
    return moved
