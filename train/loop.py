"""Train a DFlash drafter.

    accelerate launch train/dflash.py --config configs/testbed.yaml [section.key=value ...]

Stage "general" trains on the target-regenerated mixture, stage "finetune" starts from a stage-1
checkpoint (`train.init_from`, weights only) and trains on trajectory datasets. A run continues from
the newest checkpoint in its output_dir (model, optimizer, scheduler, RNG, data position), after
checking that its settings still mean the same run (train/checkpointing.py). A non-finite loss or gradient
norm skips the step; train.max_nonfinite_steps of them in a row, or a non-finite weight, stop the run
(exit status 3) with the last finite checkpoint as the newest. So does a finite blow-up: a loss or gradient
norm that stays far above its best (train/divergence.py); the message names the last good checkpoint.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from tqdm.auto import tqdm
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from common.atomic_files import write_json_atomic
from common.dtypes import native_bf16
from configs.schema import PipelineConfig
from data.sources.mixture import greedy_response_spans
from drafters.drafter.blocks import sample_anchors
from drafters.drafter.checkpoint import find_drafter_folder, load_drafter, save_drafter
from drafters.drafter.model import DFlashDrafter
from drafters.drafter.objective import (
    HeadVocabulary,
    acceptance_stats,
    block_loss,
    block_targets,
    copy_loss,
    copy_reads,
    copy_sources,
    copy_value_loss,
    default_gamma,
    greedy_path,
    most_frequent_tokens,
    slot_weights,
)
from drafters.target.capture import Captured
from drafters.target.frozen import FrozenTargetHead
from drafters.target.loading import load_target_config
from train.batches import (
    Batch,
    DatasetError,
    check_training_dataset,
    collate,
    epoch_batches,
    epoch_rows,
    shard_batches,
)
from train.checkpointing import (
    TrainerState,
    check_config_drift,
    check_resumable,
    is_deepspeed,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from train.divergence import DivergenceGuard, last_good_checkpoint, set_aside_after
from train.features import TargetChoices, choices_store, feature_source
from train.setup import (
    cache_root,
    resolve_draft_config,
    resolve_target,
    training_dataset,
)

EXIT_DIVERGED = 3


class TrainingDiverged(RuntimeError):
    """Non-finite losses, gradient norms or weights: the run stops; its newest checkpoint is the last finite one."""


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def mixed_precision(config: PipelineConfig) -> str:
    choice = config.train.dtype
    if choice == "auto":
        # bf16 where the hardware multiplies it natively (GPUs, CPUs with AVX512-BF16 or AMX: ~3x faster than
        # fp32); an AVX2 CPU emulates it about 5x slower than fp32.
        return "bf16" if native_bf16("cuda" if torch.cuda.is_available() else "cpu") else "no"
    return "bf16" if choice == "bf16" else "no"


def train(config: PipelineConfig) -> Path:
    started = time.perf_counter()
    tc = config.train
    accelerator = make_accelerator(config)
    use_cpu_threads(accelerator, tc.cpu_threads)
    set_seed(tc.seed, deterministic=not torch.cuda.is_available())
    output_dir, log = Path(config.output_dir), accelerator.print

    # Everything that can be refused is checked before any training work, the cheap checks first.
    existing = checkpoint_to_resume(config, accelerator, log)
    target_path = resolve_target(config, log)
    target_config = load_target_config(target_path, config.target.trust_remote_code)
    drafter = initial_drafter(config, target_path, target_config, log)
    draft_config = drafter.config
    dataset = training_dataset(config, target_path, accelerator, drafter.target_layer_ids)
    dataset_name = str(config.data.dataset or config.train.stage)
    check_training_dataset(dataset, dataset_name, config.data.max_seq_len)
    rows = epoch_rows(dataset, dataset_name, tc.category_repeats)
    if tc.category_repeats:
        log(f"[train] an epoch visits {len(rows)} rows: {len(dataset)} sequences, {tc.category_repeats} repeated")

    head_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    head = FrozenTargetHead.from_pretrained(target_path, dtype=head_dtype, device=accelerator.device)
    features_of = feature_source(config, dataset, target_path, drafter.target_layer_ids, accelerator, cache_root(config))
    drafter.train()

    rank, world = accelerator.process_index, accelerator.num_processes
    total_steps = count_steps(rows, tc, rank, world)
    optimizer, scheduler = make_optimizer(drafter, tc, total_steps)
    drafter, optimizer = prepare(accelerator, drafter, optimizer, tc)
    parts = {"model": drafter, "optimizer": optimizer, "scheduler": scheduler}
    state = TrainerState()
    if existing is not None:
        state = resume(accelerator, existing, parts, tc, log)
        started -= state.elapsed_seconds  # wall time is counted per process run; a resumed run adds its own
    start_trackers(config, accelerator, target_path)

    pad_id = target_config.pad_token_id if isinstance(target_config.pad_token_id, int) else 0
    objective = Objective.build(config, draft_config, head, dataset, features_of, pad_id, accelerator)
    save_serving_drafter = serving_drafter_writer(accelerator, drafter, draft_config)
    progress = tqdm(total=total_steps, initial=state.step, desc="train", disable=not accelerator.is_local_main_process)
    window, health = _new_window(), StepHealth()
    guard = DivergenceGuard(tc.divergence_loss_factor, tc.divergence_grad_norm_factor, tc.divergence_weight_norm_factor,
                            tc.divergence_patience, state.guard)
    step_loss, grad_norm = 0.0, None

    while state.step < total_steps:
        batches = shard_batches(epoch_batches(rows, tc.batch_size, seed=tc.seed, epoch=state.epoch), rank, world)
        usable = len(batches) - len(batches) % tc.grad_accum
        for batch_idx in range(state.batch_in_epoch, usable):
            batch = collate(dataset, batches[batch_idx], config.data.max_seq_len, pad_id)
            # Seeded by the batch's place in the epoch's global order: the same anchors whatever the process count.
            generator = torch.Generator().manual_seed(anchor_seed(tc.seed, state.epoch, batch_idx * world + rank))
            with accelerator.accumulate(drafter):
                out, anchor_valid = objective(drafter, batch, features_of(batch), generator)
                accelerator.backward(out.loss)
                loss = out.loss.item()
                health.finite &= math.isfinite(loss)
                if accelerator.sync_gradients:
                    grad_norm = optimizer_step(accelerator, drafter, optimizer, tc.grad_clip, health)
            step_loss += loss / tc.grad_accum
            _record_micro_batch(window, loss / tc.grad_accum, out, anchor_valid, len(batch.indices), draft_config.block_size)
            state.batch_in_epoch = batch_idx + 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            state.step += 1
            state.elapsed_seconds = time.perf_counter() - started
            window["steps"] += 1
            progress.update(1)
            health.end_step(state.step, window, log)
            weight_norm = _check_divergence(accelerator, drafter, state.step, health.nonfinite_run,
                                            tc.max_nonfinite_steps, output_dir)
            if not health.nonfinite_run:
                blow_up = guard.update(_mean_over_ranks(accelerator, step_loss), grad_norm, weight_norm)
                if blow_up:
                    raise _diverged(accelerator, state.step, blow_up, output_dir)
            state.healthy, state.guard = guard.healthy, guard.to_dict()
            step_loss, grad_norm = 0.0, None
            window = after_step(config, accelerator, state, total_steps, window, scheduler, objective.keep_prob,
                                progress, save_serving_drafter, parts)
            if state.step >= total_steps:
                break
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
    progress.close()
    accelerator.end_training()
    final = latest_checkpoint(output_dir)
    log(f"[train] done: {total_steps} steps; drafter at {final / 'drafter'}")
    return final / "drafter"


# --------------------------------------------------------------------------------------------------
# Phases of a run, in the order train() calls them
# --------------------------------------------------------------------------------------------------

def use_cpu_threads(accelerator: Accelerator, cpu_threads: int | None) -> None:
    if accelerator.device.type == "cpu":
        # `accelerate launch` exports OMP_NUM_THREADS=1 unless told otherwise, which halves a 2-core run.
        threads = cpu_threads or max(1, len(os.sched_getaffinity(0)) // accelerator.num_processes)
        torch.set_num_threads(threads)
        accelerator.print(f"[train] CPU: {threads} torch threads per process")


def checkpoint_to_resume(config: PipelineConfig, accelerator: Accelerator, log) -> Path | None:
    """The newest checkpoint of output_dir, once it is known to continue this run; None for a new run."""
    output_dir, tc = Path(config.output_dir), config.train
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"output_dir {output_dir} exists and is not a folder")
    existing = latest_checkpoint(output_dir)
    if existing is None:
        return None
    if not tc.resume:
        raise ValueError(f"output_dir {output_dir} already holds checkpoints (newest {existing.name}) and train.resume is false; use a new output_dir")
    check_config_drift(existing, config, log)
    check_resumable(existing, tc.trust_checkpoint_pickles, is_deepspeed(accelerator), log)
    return existing


def initial_drafter(config: PipelineConfig, target_path: Path, target_config, log) -> DFlashDrafter:
    if config.train.init_from:
        # Stage 2 keeps the stage-1 drafter's architecture, target layers and mask token.
        log(f"[train] init_from {config.train.init_from} (weights only; its architecture replaces the drafter section)")
        return load_drafter(find_drafter_folder(config.train.init_from), target_config=target_config).float()
    return DFlashDrafter(resolve_draft_config(config, target_path, target_config))


def count_steps(rows: list[int], tc, rank: int, world: int) -> int:
    """Optimizer steps of the run: every process takes the same number of batches, tc.grad_accum per step."""
    batches_per_epoch = len(shard_batches(epoch_batches(rows, tc.batch_size, seed=tc.seed, epoch=0), rank, world))
    if batches_per_epoch < tc.grad_accum:
        raise DatasetError(f"{len(rows)} sequences give {batches_per_epoch} batches per process, fewer than grad_accum={tc.grad_accum}")
    return tc.max_steps or batches_per_epoch // tc.grad_accum * tc.epochs


def make_optimizer(drafter: DFlashDrafter, tc, total_steps: int):
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=math.ceil(tc.warmup_ratio * total_steps), num_training_steps=total_steps,
        min_lr_rate=tc.min_lr_ratio,
    )
    return optimizer, scheduler


def prepare(accelerator: Accelerator, drafter, optimizer, tc):
    if is_deepspeed(accelerator):
        # No dataloader goes through prepare(): DeepSpeed learns the micro-batch and clipping from here.
        accelerator.state.deepspeed_plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=tc.batch_size, gradient_clipping=tc.grad_clip)
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    if accelerator.gradient_accumulation_steps != tc.grad_accum:
        raise ValueError(f"the launcher accumulates {accelerator.gradient_accumulation_steps} micro-batches per step, "
                         f"train.grad_accum is {tc.grad_accum}; remove gradient_accumulation_steps from the accelerate config")
    return drafter, optimizer


def resume(accelerator: Accelerator, checkpoint: Path, parts: dict, tc, log) -> TrainerState:
    state = load_checkpoint(accelerator, checkpoint, **parts, trusted=tc.trust_checkpoint_pickles)
    _apply_config_hyperparameters(parts["optimizer"], parts["scheduler"], tc)
    log(f"[train] resumed from {checkpoint} (step {state.step}, epoch {state.epoch}, batch {state.batch_in_epoch})")
    return state


def start_trackers(config: PipelineConfig, accelerator: Accelerator, target_path: Path) -> None:
    if not config.logging.wandb:
        return
    os.environ.setdefault("WANDB_MODE", config.logging.wandb_mode)
    accelerator.init_trackers(
        config.logging.wandb_project,
        config={**config.model_dump(mode="json"), "git_revision": git_revision(), "target_path": str(target_path)},
        init_kwargs={"wandb": {"name": config.run_name, "dir": str(config.output_dir)}},
    )


def serving_drafter_writer(accelerator: Accelerator, drafter, draft_config):
    """save(path): the drafter in serving format (bf16 safetensors + config), written by the main process."""
    def save(path: Path) -> None:
        weights = accelerator.get_state_dict(drafter)  # collective (gathers ZeRO-3 shards)
        if accelerator.is_main_process:
            copy = DFlashDrafter(draft_config)
            copy.load_state_dict({k: v.float() for k, v in weights.items()})
            save_drafter(copy, path, dtype=torch.bfloat16)
    return save


class Objective:
    """What one micro-batch is scored on: anchors, block targets along the target's greedy path, the loss."""

    def __init__(self, tc, block_size: int, head: FrozenTargetHead, head_vocab: HeadVocabulary,
                 choices_of: TargetChoices | None, accelerator: Accelerator):
        self.tc, self.block_size, self.head, self.head_vocab, self.choices_of = tc, block_size, head, head_vocab, choices_of
        self.device, self.autocast = accelerator.device, accelerator.autocast
        self.gamma = tc.gamma or default_gamma(block_size)
        self.keep_prob = slot_weights(block_size, self.gamma) if tc.sample_slots else None

    @classmethod
    def build(cls, config: PipelineConfig, draft_config, head: FrozenTargetHead, dataset, features_of, pad_id: int,
              accelerator: Accelerator) -> "Objective":
        tc, log = config.train, accelerator.print
        needs_choices = tc.anchor_scope == "sequence" or tc.loss == "ce_target"
        choices_of = TargetChoices(head.lm_head.weight, tc.logits_chunk, store=choices_store(features_of),
                                   num_rows=len(dataset), writes=accelerator.is_main_process,
                                   next_token_spans=(greedy_response_spans(config.data.mixture, dataset)
                                                     if config.rows_from == "mixture" else None),
                                   earlier=getattr(features_of, "earlier", None)) if needs_choices else None
        if choices_of is not None and choices_of.loaded:
            log(f"[train] the target's greedy choices of every row read from {choices_of.store}")
        head_vocab = training_head(head.lm_head.weight, tc.head_vocab, log, lambda: emitted_token_counts(
            dataset, features_of, choices_of, tc.batch_size, config.data.max_seq_len, pad_id, head.vocab_size))
        if choices_of is not None and choices_of.projected_positions:
            known = sum(len(row) for row in choices_of.rows.values())
            log(f"[train] the target's greedy choices: {choices_of.projected_positions} of {known} positions projected "
                f"onto the vocabulary, {choices_of.copied_positions} copied from earlier caches' rows, the rest read "
                f"from its greedy responses")
        return cls(tc, draft_config.block_size, head, head_vocab, choices_of, accelerator)

    def __call__(self, drafter, batch: Batch, features: Captured, generator: torch.Generator):
        tc = self.tc
        supervised = batch.loss_mask if tc.anchor_scope == "loss_mask" else batch.attention_mask.bool()
        anchors, anchor_valid = sample_anchors(supervised, tc.anchors_per_seq, generator)
        input_ids = batch.input_ids.to(self.device)
        anchors, anchor_valid = anchors.to(self.device), anchor_valid.to(self.device)
        choices = self.choices_of(batch, features) if self.choices_of else None
        on_path = greedy_path(input_ids, choices) if tc.anchor_scope == "sequence" else None
        sources = reads = None
        if tc.copy_heads:
            sources = copy_sources(input_ids, batch.attention_mask.to(self.device), anchors, anchor_valid,
                                   tc.copy_heads, max(int(anchors.max()), 1))
            if tc.copy_value_weight:
                reads = copy_reads(sources, tc.copy_value_rows, generator)
        with self.autocast():
            hidden = drafter(features.selected, input_ids, anchors, self.head.embed, copy_heads=tc.copy_heads,
                             copy_query=tc.copy_query, copy_reads=None if reads is None else reads[:2])
        copy = value_loss = None
        if tc.copy_heads:
            hidden, copy_logp, *writes = hidden
            copy = copy_loss(copy_logp, sources)
            if reads is not None:
                rows, positions, heads = reads
                value_loss = copy_value_loss(writes[0][torch.arange(len(heads), device=heads.device), heads],
                                             input_ids[rows, positions], self.head_vocab, tc.logits_chunk)
        targets = block_targets(anchors, anchor_valid, supervised.to(self.device), self.block_size, on_path)
        out = block_loss(hidden.float(), targets, features.final_hidden, input_ids, self.head_vocab,
                         gamma=self.gamma, kind=tc.loss, choices=choices, temperature=tc.kl_temperature,
                         chunk_rows=tc.logits_chunk, sample_slots=generator if tc.sample_slots else None,
                         tv_eta=tc.tv_eta)
        if copy is not None:
            out.loss = out.loss + tc.copy_weight * copy.loss
            out.copy_mass = copy.mass
        if value_loss is not None:
            out.loss = out.loss + tc.copy_value_weight * value_loss
            out.copy_value_loss = value_loss.detach()
        return out, anchor_valid


class StepHealth:
    """Whether the current optimizer step is finite on every rank, and how many steps in a row were not."""

    def __init__(self):
        self.finite, self.nonfinite_run = True, 0

    def end_step(self, step: int, window: dict, log) -> None:
        self.nonfinite_run = 0 if self.finite else self.nonfinite_run + 1
        self.finite = True
        if self.nonfinite_run:
            window["nonfinite_steps"] += 1
            log(f"[train] step {step}: non-finite loss or gradient norm, step skipped ({self.nonfinite_run} in a row)")


def optimizer_step(accelerator: Accelerator, drafter, optimizer, grad_clip: float, health: StepHealth) -> float | None:
    """Clip, step when finite on every rank; returns the gradient norm before clipping (None under DeepSpeed)."""
    grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), grad_clip)
    grad_norm = None if grad_norm is None else float(grad_norm)
    health.finite = _on_every_rank(accelerator, health.finite and (grad_norm is None or math.isfinite(grad_norm)))
    if health.finite:  # DeepSpeed has stepped inside backward already; the weight check stops a diverged run
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def after_step(config: PipelineConfig, accelerator: Accelerator, state: TrainerState, total_steps: int, window: dict,
               scheduler, keep_prob, progress, save_serving_drafter, parts: dict) -> dict:
    """Logs every train.log_every steps, keeps snapshots and checkpoints; returns the metrics window to fill next."""
    tc, output_dir, last = config.train, Path(config.output_dir), state.step == total_steps
    if state.step % tc.log_every == 0 or last:
        metrics = _window_metrics(window, scheduler.get_last_lr()[0], accelerator.num_processes, keep_prob)
        sequences = accelerator.reduce(torch.tensor([window["sequences"]], device=accelerator.device), reduction="sum")
        metrics["sequences_per_step"] = float(sequences.item()) / window["steps"]
        window = _new_window()
        state.metrics = metrics
        progress.set_postfix(loss=f"{metrics['loss']:.3f}", acc1=f"{metrics['slot1_acc']:.2f}", tau=f"{metrics['sim_tau']:.2f}")
        accelerator.log(metrics, step=state.step)
    if tc.snapshot_every and (state.step % tc.snapshot_every == 0 or last):
        snapshot = output_dir / "snapshots" / f"step-{state.step:06d}"
        save_serving_drafter(snapshot)
        if accelerator.is_main_process:
            write_json_atomic(snapshot / "trainer_state.json", asdict(state))
    if state.step % tc.save_every == 0 or last:
        save_checkpoint(accelerator, output_dir, state, save_serving_drafter, tc.keep_last,
                        run_config=config.model_dump(mode="json"), **parts)
    return window


def anchor_seed(seed: int, epoch: int, global_batch: int) -> int:
    return (((seed * 1_000_003 + epoch) * 1_000_003 + global_batch) * 64) % 2**63


def make_accelerator(config: PipelineConfig) -> Accelerator:
    """train.grad_accum micro-batches per optimizer step under every launcher (single process, DDP, DeepSpeed)."""
    launched = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if launched is not None and launched != str(config.train.grad_accum):
        # accelerate launch exports the accelerate config's value and both Accelerator and DeepSpeed prefer it
        # to the argument: a pinned 1 would make every micro-batch an optimizer step.
        print(f"[train] the accelerate config's gradient_accumulation_steps={launched} is replaced by "
              f"train.grad_accum={config.train.grad_accum}", file=sys.stderr)
        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(config.train.grad_accum)
    on_cpu = not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    # Rank 0 may regenerate the mixture while the others wait in a barrier; the default 30-minute
    # collective timeout would kill such a first run. (The feature cache is never captured behind a
    # barrier: a multi-process run reads the one `dflash-pipeline prepare` made.)
    group = {"timeout": timedelta(hours=12)}
    if on_cpu and deepspeed:
        group["backend"] = "gloo"  # accelerate starts DeepSpeed only off the CPU unless given a CPU backend
    return Accelerator(
        cpu=on_cpu and not deepspeed,
        mixed_precision=mixed_precision(config),
        gradient_accumulation_steps=config.train.grad_accum,
        step_scheduler_with_optimizer=False,
        log_with="wandb" if config.logging.wandb else None,
        kwargs_handlers=[InitProcessGroupKwargs(**group)],
    )


def training_head(lm_head_weight: torch.Tensor, size: int | None, log, token_counts) -> HeadVocabulary:
    """The full lm_head, or its rows for the `size` tokens the target emits most often on the training data."""
    if size is None or size >= lm_head_weight.shape[0]:
        return HeadVocabulary(lm_head_weight)
    counts = token_counts()
    ids = most_frequent_tokens(counts, size)
    covered = float(counts[ids].sum() / counts.sum().clamp_min(1))
    log(f"[train] training head: {len(ids)} of {lm_head_weight.shape[0]} vocabulary rows, the tokens the target "
        f"emits most often on the training data ({covered:.1%} of its choices); serving uses the full head")
    return HeadVocabulary(lm_head_weight, ids)


def emitted_token_counts(dataset, features_of, choices_of, batch_size: int, max_seq_len: int, pad_id: int,
                         vocab_size: int) -> torch.Tensor:
    """How often the target chooses each token after the training data's positions (its greedy choices:
    the labels of ce_target and the argmax of KL). Without choices (CE to the data), the data's tokens.
    The choices are kept per row, so training reuses them (this moves the first epoch's argmax up front)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for start in tqdm(range(0, len(dataset), batch_size), desc="head vocabulary", leave=False):
        batch = collate(dataset, list(range(start, min(start + batch_size, len(dataset)))), max_seq_len, pad_id)
        tokens = choices_of(batch, features_of(batch)).cpu() if choices_of else batch.input_ids
        counts += torch.bincount(tokens[batch.attention_mask.bool()], minlength=vocab_size)[:vocab_size]
    return counts


def _apply_config_hyperparameters(optimizer, scheduler, tc) -> None:
    """The config's lr schedule and weight decay, not the checkpoint's: the same values unless
    train.resume_allow_config_change let them change, and then they apply from the resumed step on."""
    scheduler.base_lrs = [tc.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = tc.lr
        group["lr"] = tc.lr * factor(scheduler.last_epoch)
        group["weight_decay"] = tc.weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _on_every_rank(accelerator, flag: bool) -> bool:
    """flag held on every process (the ranks must agree on skipping a step)."""
    if accelerator.num_processes == 1:
        return flag
    failed = accelerator.reduce(torch.tensor([0.0 if flag else 1.0], device=accelerator.device), reduction="sum")
    return bool(failed.item() == 0)


def _mean_over_ranks(accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return value
    return float(accelerator.reduce(torch.tensor([value], device=accelerator.device), reduction="mean").item())


def _diverged(accelerator, step: int, why: str, output_dir: Path) -> TrainingDiverged:
    """The error that stops a diverged run. The checkpoints written after the last good one are moved to
    checkpoints/diverged/ (kept, but out of a resume's way)."""
    good = last_good_checkpoint(output_dir)
    moved = set_aside_after(output_dir, good) if accelerator.is_main_process else []
    kept = (f"the last good checkpoint is {good}" if good else
            "no good checkpoint was written before it" if moved else "no checkpoint was written")
    if moved:
        kept += f" ({len(moved)} written after it moved to {moved[0].parent})"
    if good:
        kept += "; a rerun resumes from it"
    return TrainingDiverged(f"training diverged at step {step}: {why}; {kept}. Lower train.lr or check the data.")


def _check_divergence(accelerator, drafter, step: int, nonfinite_run: int, limit: int, output_dir: Path) -> float:
    """Stops a run with non-finite steps or weights; returns the weights' L2 norm."""
    if nonfinite_run >= limit:
        raise _diverged(accelerator, step, f"the loss or gradient norm was non-finite in {nonfinite_run} steps in "
                        f"a row (train.max_nonfinite_steps={limit})", output_dir)
    params = list(drafter.named_parameters())
    norm = float(torch.linalg.vector_norm(torch.stack([p.detach().float().norm() for _, p in params])))
    if not math.isfinite(norm):
        bad = [name for name, p in params if not torch.isfinite(p).all()]
        raise _diverged(accelerator, step, f"non-finite weights in {len(bad)} tensor(s) "
                        f"({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})", output_dir)
    return norm


def _record_micro_batch(window: dict, loss: float, out, anchor_valid: torch.Tensor, sequences: int, block_size: int) -> None:
    if math.isfinite(loss):
        window["loss"] += loss
    window["correct"].append(out.slot_correct.flatten(0, 1).cpu())
    window["valid"].append(out.slot_valid.flatten(0, 1).cpu())
    if out.copy_mass is not None:
        window["copy_mass"].append(float(out.copy_mass))
    if out.copy_value_loss is not None:
        window["copy_value_loss"].append(float(out.copy_value_loss))
    window["tokens"] += int(anchor_valid.sum()) * block_size
    window["sequences"] += sequences


def _new_window() -> dict:
    return {"loss": 0.0, "steps": 0, "nonfinite_steps": 0, "correct": [], "valid": [], "tokens": 0, "sequences": 0,
            "copy_mass": [], "copy_value_loss": [], "start": time.perf_counter()}


def _window_metrics(window: dict, lr: float, world: int, keep_prob: torch.Tensor | None) -> dict:
    correct, valid = torch.cat(window["correct"]), torch.cat(window["valid"])
    stats = acceptance_stats(correct, valid, keep_prob)
    seconds = max(time.perf_counter() - window["start"], 1e-9)
    return {
        "loss": window["loss"] / max(window["steps"] - window["nonfinite_steps"], 1),
        "nonfinite_steps": window["nonfinite_steps"],
        "lr": lr,
        "sim_tau": stats["sim_tau"],
        "slot1_acc": stats["slot_accuracy"][0],
        **{f"slot_acc/{k + 1}": acc for k, acc in enumerate(stats["slot_accuracy"])},
        "block_tokens_per_s": window["tokens"] * world / seconds,
        **({"copy_attention_mass": sum(window["copy_mass"]) / len(window["copy_mass"])} if window["copy_mass"] else {}),
        **({"copy_value_loss": sum(window["copy_value_loss"]) / len(window["copy_value_loss"])}
           if window["copy_value_loss"] else {}),
    }
