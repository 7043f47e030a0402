"""speculators' DFlash drafter, loss, data pipeline and optimizer, stepped by a plain loop on the CPU.

Run with the python of a virtual environment that has PyPI `speculators` 0.9.0 (not ours):

    SPECULATORS_PYTHON bench/peers/speculators_loop.py --out RUN --time-limit S --snapshot-every N -- \
        --verifier-name-or-path TARGET --data-path DATA --draft-config CONFIG.json --max-steps STEPS ...

Everything after `--` is the `speculators train` command line, resolved by speculators' own TrainConfig.
speculators' Trainer cannot run on a CPU: `Trainer.setup_model` moves the model to `self.local_rank`
(the integer 0, an accelerator index), which fails with "RuntimeError: Cannot access accelerator device
when none is available" (speculators/train/trainer.py:348). So this script builds what `speculators.train.cli.main`
builds, with speculators' own functions: the draft model (`build_draft_model`: their DFlashDraftModel,
verifier embedding and lm_head), the vocabulary choice, the packed data loaders (`create_train_val_loaders`),
the per-call loss settings (`get_trainer_kwargs`: their loss, D-PACE weighting, anchors), the optimizers
(`build_optimizers`: Muon + AdamW by default) and the LR schedule; and then steps them the way
`Trainer.train_epoch` does (bf16 autocast, backward, clip 1.0, every optimizer, every scheduler), on the CPU.

Writes RUN/snapshots/step-NNNNNN/ (reference-format drafter + trainer_state.json with the wall seconds
since start, the layout of our trainer's snapshots) and RUN/result.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from argparse import Namespace
from pathlib import Path

import torch

REFERENCE_PREFIXES = ("layers.", "fc.", "hidden_norm.", "norm.")


def reference_state(model) -> dict:
    """The draft weights under the reference names (speculators' names are the same); the verifier's
    embedding, lm_head and norm are not the drafter's."""
    return {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in model.state_dict().items()
            if name.startswith(REFERENCE_PREFIXES)}


def save_snapshot(model, draft_config: Path, folder: Path, state: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(reference_state(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(draft_config.read_text())
    (folder / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")


def schedulers(optimizers, trainer_config, loader_len: int):
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup
    from speculators.train.trainer import _resolve_scheduler_steps

    if trainer_config.scheduler_type == "none":
        return []
    warmup, total = _resolve_scheduler_steps(trainer_config, loader_len)
    if trainer_config.scheduler_type == "linear":
        return [get_linear_schedule_with_warmup(o, num_warmup_steps=warmup, num_training_steps=total) for o in optimizers]
    return [get_cosine_schedule_with_warmup(o, num_warmup_steps=warmup, num_training_steps=total,
                                            num_cycles=trainer_config.scheduler_num_cosine_cycles) for o in optimizers]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds (a guard)")
    parser.add_argument("--snapshot-every", type=int, default=0)
    parser.add_argument("peer_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    peer_argv = args.peer_args[1:] if args.peer_args[:1] == ["--"] else args.peer_args
    started = time.perf_counter()

    from speculators.model import SpeculatorModel
    from speculators.train import cli as spec_cli
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from hs_connectors import HiddenStatesBackend

    cfg = TrainConfig.resolve(peer_argv)
    flat = Namespace(**cfg.flatten())
    spec_cli.set_seed(flat.seed, flat.deterministic_cuda)
    if flat.speculator_type != "dflash":
        raise SystemExit(f"this loop runs speculators' dflash drafter, not {flat.speculator_type!r}")
    d2t, t2d, draft_vocab_size = spec_cli.parse_vocab_mappings(flat)
    model_class = SpeculatorModel.registry[flat.speculator_type]
    model = spec_cli.build_draft_model(flat, model_class, t2d, d2t, draft_vocab_size)
    hidden_states_dtype = getattr(torch, flat.hidden_states_dtype)
    transfer = HiddenStatesBackend.registry[flat.hidden_states_backend].from_train_args(flat, flat.data_path)
    train_loader, _ = create_train_val_loaders(
        data_path=flat.data_path, total_seq_len=flat.total_seq_len, hidden_states_dtype=hidden_states_dtype,
        transfer=transfer, vllm_endpoint=flat.vllm_endpoint, on_missing=flat.on_missing,
        verifier_name_or_path=flat.verifier_name_or_path, request_timeout=flat.request_timeout,
        max_retries=flat.max_retries, generation_validation_retries=flat.generation_validation_retries,
        max_consecutive_generation_failures=flat.max_consecutive_generation_failures,
        hidden_size=model.config.transformer_layer_config.hidden_size,
        num_target_layers=len(model.target_layer_ids), num_workers=flat.num_workers,
        prefetch_factor=flat.prefetch_factor, preprocess=None, train_data_ratio=flat.train_data_ratio, seed=flat.seed)
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(flat))
    trainer_config = TrainerConfig(
        num_epochs=flat.epochs, save_path=flat.save_path, lr=flat.lr, optimizer=flat.optimizer,
        weight_decay=flat.weight_decay, muon_lr=flat.muon_lr, muon_momentum=flat.muon_momentum,
        muon_weight_decay=flat.muon_weight_decay, muon_ns_steps=flat.muon_ns_steps,
        muon_adjust_lr_fn=flat.muon_adjust_lr_fn, scheduler_type=flat.scheduler_type,
        scheduler_warmup_steps=flat.scheduler_warmup_steps, scheduler_warmup_ratio=flat.scheduler_warmup_ratio,
        scheduler_total_steps=flat.scheduler_total_steps, scheduler_num_cosine_cycles=flat.scheduler_num_cosine_cycles,
        hidden_states_dtype=hidden_states_dtype, max_steps=flat.max_steps)
    optimizers = build_optimizers(model, trainer_config)
    scheds = schedulers(optimizers, trainer_config, len(train_loader))

    out = Path(args.out)
    draft_config = Path(flat.draft_config)
    # Trainer.run_training stops at the end of its epochs or at max_steps, whichever comes first.
    max_steps = min(flat.max_steps or math.inf, flat.epochs * len(train_loader))
    step, epoch, losses, step_seconds = 0, 0, [], []
    first_step_at = None
    model.train()
    while step < max_steps:
        if hasattr(train_loader.batch_sampler, "set_epoch"):
            train_loader.batch_sampler.set_epoch(epoch)
        for batch in train_loader:
            t0 = time.perf_counter()
            first_step_at = first_step_at or t0
            batch = {k: v for k, v in batch.items() if k not in ("error_records",) and not k.startswith("_")}
            with torch.autocast("cpu", dtype=hidden_states_dtype):
                _, loss, metrics = model(**batch, **train_kwargs)
            for o in optimizers:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in optimizers:
                o.step()
            for s in scheds:
                s.step()
            step += 1
            step_seconds.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            if not math.isfinite(losses[-1]):
                raise SystemExit(f"non-finite loss at step {step}")
            elapsed = time.perf_counter() - started
            if step % 10 == 0 or step == 1:
                print(f"[speculators-loop] step {step}/{max_steps} loss {losses[-1]:.4f} "
                      f"{step_seconds[-1]:.2f} s/step elapsed {elapsed:.0f} s", flush=True)
            last = step >= max_steps or (args.time_limit is not None and elapsed >= args.time_limit)
            if (args.snapshot_every and step % args.snapshot_every == 0) or last:
                save_snapshot(model, draft_config, out / "snapshots" / f"step-{step:06d}",
                              {"step": step, "epoch": epoch, "elapsed_seconds": elapsed,
                               "metrics": {"loss": losses[-1]}})
            if last:
                break
        else:
            epoch += 1
            continue
        break
    result = {"trainer": "speculators (model, loss, data, optimizer; plain CPU loop)", "steps": step,
              "epochs_started": epoch + 1, "wall_seconds": time.perf_counter() - started,
              "loop_seconds": time.perf_counter() - (first_step_at or started),
              "mean_step_seconds": sum(step_seconds) / max(len(step_seconds), 1), "step_seconds": step_seconds,
              "final_loss": losses[-1] if losses else None, "batches_per_epoch": len(train_loader),
              "loss_settings": {k: str(v) for k, v in train_kwargs.items()},
              "optimizers": [type(o).__name__ for o in optimizers], "scheduler": flat.scheduler_type}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
