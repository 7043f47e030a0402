"""Continuous retraining: fine-tune the drafter on newly logged traffic, promote it only if it is better.

    dflash-pipeline retrain --config configs/retrain-testbed.yaml [section.key=value ...]
    dflash-pipeline retrain --config ... --status
    dflash-pipeline retrain --config ... --rollback v0002
    dflash-pipeline retrain --config ... --bootstrap         # v0000 = retrain.initial_drafter, then on_promote

Schedule the first form (cron, Kubernetes CronJob with concurrencyPolicy: Forbid). Each run is ONE cycle:

1. ingest the trajectory logs (``retrain.trajectories``) that arrived since the last cycle; a file is known by
   its absolute path + size + sha256, so a rewritten file is noticed; validation and quarantine are the
   data module's (``data.trajectory.reader.TrajectoryReader``, one quarantine file per cycle, the summary
   reconciles);
2. split held-out traffic off BEFORE training sees it: by a hash of the session's ROOT session id (a
   sub-agent session follows the session that spawned it), all requests of a session on one side;
3. dedup the training requests into a prefix tree -> dataset; fine-tune the currently promoted drafter on
   it (``train.loop.train``, stage finetune, weights-only ``init_from``, its own resumable output dir);
4. evaluate the current and the candidate drafter on the same held-out recent traffic (greedy, real
   speculative decoding against the target, ``eval.acceptance.evaluate``; T=0 mismatches reported);
5. promote the candidate only if its tau beats the current one by ``retrain.promotion_margin``: a new
   ``versions/vNNNN/`` (drafter, bf16 / FP8 exports, eval report) and the ``current`` symlink swapped
   atomically; older versions stay for ``--rollback``;
6. commit: one atomic write of ``state.json`` (consumed files, promoted version, cycle counter), then a
   line in ``history.jsonl`` (and wandb when ``logging.wandb``).

A cycle killed at any point leaves the promoted drafter intact; the next run resumes the same cycle
(same files, same initial drafter, training from its newest checkpoint) and consumes every file exactly
once. A cycle with no new data, or only quarantined data, trains nothing and says so. See
scripts/RETRAIN.md for the state-dir layout and the state file format.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path

from datasets import load_from_disk

from common.atomic_files import atomic_folder, write_json_atomic
from configs.schema import PipelineConfig
from data.trajectory.prefix_tree import build_prefix_tree
from data.trajectory.reader import TrajectoryReader, write_trajectories
from drafters.drafter.config import text_config
from drafters.target.loading import load_target_config
from retraining.gate import evaluate_pair, gate
from retraining.records import Cycle, Split, commit_cycle, summary_line
from retraining.state import (
    RetrainError,
    StateDir,
    copy_tree_atomic,
    load_state,
    next_version,
    now_iso,
    repair,
    save_state,
    state_lock,
)
from retraining.traffic import (
    cycle_heldout_file,
    discover,
    is_heldout,
    session_roots,
    shuffle_tokens,
    unchanged,
)
from retraining.versions import bootstrap, check_exportable, export_all, tell_engine
from train.batches import DatasetError, check_training_dataset
from train.checkpointing import latest_checkpoint, read_trainer_state
from train.loop import train
from train.setup import resolve_target

EXIT_BUSY = 75  # EX_TEMPFAIL: another cycle holds the lock
EXIT_HOOK_FAILED = 4  # the new version is current, retrain.on_promote failed: retry with --notify


def run_cycle(config: PipelineConfig, log=print) -> dict:
    """Run one retraining cycle under the state-dir lock; returns the committed history record."""
    rc = config.retrain
    if not rc.trajectories:
        raise RetrainError("retrain.trajectories lists no folder or file to read new trajectory logs from")
    sd = StateDir(rc.state_dir)
    with state_lock(sd):
        state = load_state(sd)
        repair(sd, state, log)
        return _run_cycle_locked(config, sd, state, log)


def _run_cycle_locked(config: PipelineConfig, sd: StateDir, state: dict, log) -> dict:
    cycle = open_cycle(config, sd, state, log)
    if not cycle.files:
        return commit_no_new_data(cycle)
    ingest(cycle)
    if not cycle.records:
        quarantined = cycle.record["requests"]["quarantined"]
        if quarantined:
            return cycle.finish("quarantined_only", f"all {quarantined} request(s) of the new file(s) were quarantined "
                                f"(see {cycle.dir / 'quarantine.jsonl'}); the files are marked consumed and not read again")
        return cycle.finish("no_records", "the new file(s) hold no request (empty or duplicate content); marked consumed")
    split = split_heldout(cycle)
    if not split.train:
        return cycle.finish("no_training_data", "every new request belongs to a held-out session; nothing to train on "
                            "(the held-out requests join the gate's window)", roots=split.roots)
    if not split.window:
        return cycle.finish("deferred_no_heldout", "no held-out traffic in this cycle or the window to evaluate a "
                            "candidate on; the files are NOT consumed and are read again, with newer ones, next cycle",
                            consume=False)
    dataset_dir, unusable = build_dataset(cycle, split)
    if unusable:
        return cycle.finish("no_training_data", f"the training requests give nothing to train on: {unusable}",
                            roots=split.roots)
    candidate = fine_tune(cycle, dataset_dir)
    report = evaluate_pair(cycle, candidate, split.window)
    refusal = gate(cycle, candidate, report, split.window)
    if refusal:
        return not_promoted(cycle, candidate, refusal, split.roots)
    return promote(cycle, candidate, split)


# --------------------------------------------------------------------------------------------------
# The phases
# --------------------------------------------------------------------------------------------------


def open_cycle(config: PipelineConfig, sd: StateDir, state: dict, log) -> Cycle:
    """The target, the promoted drafter (bootstrapped on the first run), and the cycle's files: a killed cycle's
    pinned set, or everything new (none: the cycle has nothing to do)."""
    started = time.time()
    target_path = resolve_target(config, log)
    target_config = load_target_config(target_path, config.target.trust_remote_code)
    bootstrap(config, sd, state, target_path, target_config, log)
    current_version = state["promoted"]
    cycle = Cycle(config, sd, state, log, started, {}, target_path, target_config, current_version,
                  sd.version_dir(current_version) / "drafter")
    check_exportable(config, cycle.current_drafter)
    ip = state.get("in_progress")
    if ip is not None:
        why = next((w for w in map(unchanged, ip["files"]) if w), None)
        if why is None and ip.get("current_version") != current_version:
            why = f"the promoted version changed from {ip.get('current_version')} to {current_version} (rollback)"
        if why is None:
            log(f"[retrain] resuming interrupted cycle {ip['cycle']} ({len(ip['files'])} file(s), started {ip['started']})")
        else:
            log(f"[retrain] discarding interrupted cycle {ip['cycle']}: {why}; starting it afresh")
            shutil.rmtree(sd.cycle_dir(ip["cycle"]), ignore_errors=True)
            ip = None
    if ip is None:
        t0 = time.time()
        files = discover(config.retrain.trajectories, state, sd)
        cycle.phase["discover"] = time.time() - t0
        cycle.number = state["cycle"] + 1
        if not files:
            return cycle
        ip = {"cycle": cycle.number, "started": now_iso(), "files": files, "current_version": current_version}
        state["in_progress"] = ip
        save_state(sd, state)
    cycle.number, cycle.files = ip["cycle"], ip["files"]
    cycle.dir = sd.cycle_dir(cycle.number)
    cycle.dir.mkdir(parents=True, exist_ok=True)
    cycle.record = {
        "id": f"cycle-{cycle.number:06d}", "event": "cycle", "cycle": cycle.number, "status": None, "reason": None,
        "started": ip["started"], "finished": None, "incoming": config.retrain.trajectories, "cycle_dir": str(cycle.dir),
        "current_version": current_version, "promoted_version": None, "promoted": False,
        "tau_current": None, "tau_candidate": None}
    return cycle


def commit_no_new_data(cycle: Cycle) -> dict:
    record = {"id": f"cycle-{cycle.number:06d}", "event": "cycle", "cycle": cycle.number, "status": "no_new_data",
              "reason": "no new or rewritten log file since the last cycle", "started": now_iso(),
              "finished": now_iso(), "incoming": cycle.config.retrain.trajectories, "current_version": cycle.current_version,
              "promoted_version": None, "promoted": False, "tau_current": None, "tau_candidate": None,
              "files": [], "seconds": {"total": round(time.time() - cycle.started, 3)}}
    commit_cycle(cycle.config, cycle.sd, cycle.state, record, [], consume=False, log=cycle.log)
    cycle.log(summary_line(record))
    return record


def ingest(cycle: Cycle) -> None:
    """Read the cycle's files (validation and quarantine are data.trajectory's): the accepted requests and the
    per-file and per-reason counts."""
    t0 = time.time()
    record, files = cycle.record, cycle.files
    to_read = [f["path"] for f in files if f["status"] != "duplicate_content"]
    quarantine = cycle.dir / "quarantine.jsonl"
    summary = None
    if to_read:
        earlier = {key: f"cycle {c}" for key, c in cycle.state["requests"].items()}
        reader = TrajectoryReader(to_read, int(text_config(cycle.target_config).vocab_size), quarantine_path=quarantine,
                                  already_consumed=earlier, max_record_bytes=cycle.config.data.max_record_bytes)
        cycle.records = list(reader)
        summary = reader.summary.check()
        write_json_atomic(cycle.dir / "ingest_summary.json", summary.to_dict())
    record["files"] = [file_entry(f, summary, cycle.log) for f in files]
    record["requests"] = {
        "read": summary.read if summary else 0, "accepted": summary.accepted if summary else 0,
        "quarantined": summary.quarantined if summary else 0,
        "by_reason": dict(sorted(summary.by_reason.items())) if summary else {},
        "blank_lines": summary.blank_lines if summary else 0}
    record["file_counts"] = dict(Counter(e["status"] for e in record["files"]))
    record["quarantine_file"] = str(quarantine) if summary is not None else None
    cycle.phase["ingest"] = time.time() - t0
    cycle.log(f"[retrain] cycle {cycle.number}: {len(files)} new file(s) {record['file_counts']}; requests read "
              f"{record['requests']['read']}, accepted {record['requests']['accepted']}, quarantined "
              f"{record['requests']['quarantined']} {record['requests']['by_reason']}"
              + (f" (quarantine: {quarantine})" if record["requests"]["quarantined"] else ""))


def file_entry(f: dict, summary, log) -> dict:
    """One file's line in the cycle record: its identity, how it arrived, what came of its requests."""
    counts = summary.files.get(f["path"]) if summary is not None else None
    entry = {"path": f["path"], "size": f["size"], "sha256": f["sha256"], "arrival": f["status"]}
    if counts is not None:
        entry.update(read=counts.read, accepted=counts.accepted, quarantined=counts.quarantined)
        entry["status"] = "ingested" if counts.accepted else ("quarantined_only" if counts.quarantined else "empty")
    else:
        entry.update(read=0, accepted=0, quarantined=0)
        entry["status"] = "duplicate_content" if f["status"] == "duplicate_content" else "empty"
    if f["status"] == "rewritten":
        log(f"[retrain] WARNING: {f['path']} was consumed in cycle {f['previous']['cycle']} and has been rewritten "
            "since; it is read again in full (the requests it held before are quarantined as already_consumed). "
            "Rotate log files instead of rewriting them (data/TRAJECTORY_FORMAT.md).")
    return entry


def split_heldout(cycle: Cycle) -> Split:
    """Held-out sessions (by a hash of the root session id) off BEFORE training sees anything; the gate's window."""
    rc, records, record = cycle.config.retrain, cycle.records, cycle.record
    roots = session_roots(records, cycle.state["session_roots"])
    heldout = [r for r in records if is_heldout(roots[r.session_id], rc.heldout_fraction)]
    held_ids = {r.request_id for r in heldout}
    train_records = [r for r in records if r.request_id not in held_ids]
    heldout_file = cycle.dir / "heldout.jsonl.gz"
    if heldout and not heldout_file.exists():
        write_trajectories(heldout, heldout_file)
    record["split"] = {
        "heldout_fraction": rc.heldout_fraction,
        "sessions": len(roots), "root_sessions": len(set(roots.values())),
        "sub_sessions_following_parent": sum(1 for s, r in roots.items() if s != r),
        "train_sessions": len({r.session_id for r in train_records}),
        "heldout_sessions": len({r.session_id for r in heldout}),
        "train_requests": len(train_records), "heldout_requests": len(heldout),
        "heldout_file": str(heldout_file) if heldout else None}
    record["heldout_file"] = str(heldout_file) if heldout else None
    earlier = [c for c in (cycle_heldout_file(cycle.sd, e) for e in reversed(cycle.state["cycles"])) if c]
    window = ([str(heldout_file)] if heldout else []) + earlier[: rc.heldout_window - (1 if heldout else 0)]
    record["split"]["gate_heldout_files"] = window
    cycle.log(f"[retrain] split: {record['split']['train_sessions']} training session(s) / {len(train_records)} "
              f"request(s), {record['split']['heldout_sessions']} held-out session(s) / {len(heldout)} request(s); "
              f"the gate reads {len(window)} held-out file(s)")
    return Split(roots, train_records, heldout, window)


def build_dataset(cycle: Cycle, split: Split) -> tuple[Path, str | None]:
    """Dedup the training requests into a prefix tree -> the training dataset (once per cycle). Returns its folder
    and, when it gives nothing to train on, why."""
    t0 = time.time()
    config, record = cycle.config, cycle.record
    tree = build_prefix_tree(split.train)
    stats = tree.stats()
    record["tokens"] = {
        "logged": int(sum(r.num_tokens for r in cycle.records)),
        "logged_train": stats.logged_tokens, "logged_output_train": stats.logged_output_tokens,
        "unique_train": stats.unique_tokens, "unique_generated_train": stats.unique_generated_tokens,
        "dedup_ratio": round(stats.dedup_ratio, 4), "tree_leaves": stats.leaves,
        "logged_heldout": int(sum(r.num_tokens for r in split.heldout))}
    dataset_dir = cycle.dir / "dataset"
    shuffled = config.retrain.shuffle_training_tokens
    if not (dataset_dir / "dataset_info.json").exists():
        dataset = tree.to_dataset(max_seq_len=config.data.max_seq_len)
        if shuffled:
            dataset = shuffle_tokens(dataset, config.data.seed + cycle.number)
        with atomic_folder(dataset_dir) as tmp:
            dataset.save_to_disk(str(tmp))
    dataset = load_from_disk(str(dataset_dir))
    record["dataset"] = {"path": str(dataset_dir), "rows": len(dataset),
                         "tokens": int(sum(len(x) for x in dataset["input_ids"])),
                         "loss_tokens": int(sum(sum(m) for m in dataset["loss_mask"])), "shuffled_tokens": shuffled}
    cycle.log(f"[retrain] dedup: {stats.logged_tokens} logged training tokens -> {stats.unique_tokens} unique "
              f"({stats.dedup_ratio:.2f}x), {len(dataset)} sequence(s), {record['dataset']['loss_tokens']} loss tokens"
              + (" [tokens SHUFFLED: retrain.shuffle_training_tokens]" if shuffled else ""))
    try:
        check_training_dataset(dataset, str(dataset_dir), config.data.max_seq_len)
    except DatasetError as err:
        return dataset_dir, str(err)
    cycle.phase["dataset"] = time.time() - t0
    return dataset_dir, None


def fine_tune(cycle: Cycle, dataset_dir: Path) -> Path:
    """Fine-tune the promoted drafter on the dataset (train.loop.train, stage finetune, resumable); the candidate."""
    t0 = time.time()
    config, cdir = cycle.config, cycle.dir
    done_marker = cdir / "train_done.json"
    if done_marker.exists():
        done = json.loads(done_marker.read_text())
        cycle.log(f"[retrain] training of cycle {cycle.number} already finished: {done['drafter']}")
    else:
        tcfg = config.model_copy(deep=True)
        tcfg.run_name = f"{config.run_name}-retrain-cycle{cycle.number:04d}"
        tcfg.output_dir = str(cdir / "train")
        tcfg.target.path = str(cycle.target_path)
        tcfg.data.dataset = str(dataset_dir)
        tcfg.data.trajectories = []
        tcfg.train.stage = "finetune"
        tcfg.train.init_from = str(cycle.current_drafter)
        tcfg.train.resume = True
        if config.features.mode == "offline":  # this cycle's feature cache lives (and dies) with the cycle
            tcfg.cache_dir = str(cdir / "feature-cache")
        cycle.log(f"[retrain] fine-tuning {cycle.current_version} -> candidate in {tcfg.output_dir}")
        drafter_dir = train(tcfg)
        last = latest_checkpoint(tcfg.output_dir)
        done = {"drafter": str(drafter_dir), "step": read_trainer_state(last).step,
                "metrics": read_trainer_state(last).metrics, "init_from": str(cycle.current_drafter)}
        write_json_atomic(done_marker, done)
    if (cdir / "train" / "feature_capture.json").exists():  # offline features: what the target ran for this cycle
        cycle.record["features"] = json.loads((cdir / "train" / "feature_capture.json").read_text())
    cycle.record["train"] = {"init_from": done["init_from"], "steps": done["step"], "final_metrics": done["metrics"],
                             "output_dir": str(cdir / "train")}
    cycle.phase["train"] = time.time() - t0
    return Path(done["drafter"])


def promote(cycle: Cycle, candidate: Path, split: Split) -> dict:
    """A new versions/vNNNN/ (drafter, exports, eval report), committed as the promoted version."""
    t0 = time.time()
    record, sd, number, current = cycle.record, cycle.sd, cycle.number, cycle.current_version
    tau_cur, tau_cand = record["tau_current"], record["tau_candidate"]
    version = next_version(cycle.state)
    vdir = sd.version_dir(version)
    if vdir.exists():
        shutil.rmtree(vdir)  # built by a run killed before its commit: not referenced by the state
    copy_tree_atomic(candidate, vdir / "drafter")
    card = {"target": str(cycle.target_path), "tau": {"agentic_heldout": round(tau_cand, 4)},
            "data": f"retrain cycle {number}: fine-tuned from {current} on {len(split.train)} logged requests "
                    f"({record['tokens']['unique_train']} unique tokens)"}
    exports = export_all(cycle.config, vdir / "drafter", vdir, card)
    copy_tree_atomic(cycle.dir / "eval", vdir / "eval")
    info = {"version": version, "cycle": number, "created": now_iso(), "source": f"retrain cycle {number}",
            "parent": current, "drafter": str(vdir / "drafter"), "exports": exports, "tau": tau_cand,
            "tau_parent": tau_cur, "heldout_files": split.window}
    write_json_atomic(vdir / "version.json", info)
    cycle.phase["export"] = time.time() - t0
    record["promoted"], record["promoted_version"] = True, version
    record["exports"] = exports
    gain = tau_cand / tau_cur - 1.0
    margin = cycle.config.retrain.promotion_margin
    finished = cleanup_after(cycle, cycle.finish(
        "promoted", f"candidate tau {tau_cand:.3f} beats {current} tau {tau_cur:.3f} by {gain:+.1%} "
        f"(margin {margin:.1%}); {version} is now current", roots=split.roots,
        version=(version, {k: info[k] for k in ("cycle", "created", "source", "parent", "tau")})))
    tell_engine(cycle.config, "promote", version, sd, cycle.log)
    return finished


def not_promoted(cycle: Cycle, candidate: Path, reason: str, roots) -> dict:
    kept = cycle.dir / "candidate"
    if not kept.exists():
        copy_tree_atomic(candidate, kept)
    return cleanup_after(cycle, cycle.finish("not_promoted", reason + f" (candidate kept in {kept})", roots=roots))


def cleanup_after(cycle: Cycle, record: dict) -> dict:
    """After the commit: drop the cycle's feature cache, and its training checkpoints (optimizer state)
    unless asked to keep them."""
    shutil.rmtree(cycle.dir / "feature-cache", ignore_errors=True)
    if not cycle.config.retrain.keep_checkpoints:
        shutil.rmtree(cycle.dir / "train" / "checkpoints", ignore_errors=True)
    return record


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
