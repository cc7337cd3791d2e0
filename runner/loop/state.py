"""Checkpoint state: what the loop saves (and when its step-N files rotate), and how it resumes from a checkpoint
or takes only its weights.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the pre-launch checks read
the file first, the worker loads it through the strategy and hands the dict here; writing goes through the
strategy's checkpoint IO (`runner.checkpoint_io`).
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import torch

from runner.checkpoint_io import CheckpointError
from runner.checkpoint_io.plain import unloadable
from runner.checkpoint_io.trust import check as check_checkpoint, task_name
from runner.config import ConfigError
from runner.loop.optimizers import optimizers_of
from runner.loop.schedule import Progress
from runner.loop.step import NonFiniteLossError
from runner.schedulers import configured, described, plan, schedule_change, unreachable

log = logging.getLogger("runner")


def state_dict(loop: Any) -> dict:
    p = loop.progress
    return {
        "model": loop.strategy.unwrap(loop.wrapped).model.state_dict(),
        "optimizer": loop.optimizer.state_dict(),
        "scheduler": loop.scheduler.state_dict(),
        "precision": loop.precision.state_dict(),
        "optimizer_class": type(loop.optimizer).__name__,
        "task": task_name(loop.task.task),  # a checkpoint of another task is refused by name
        "step": p.step,
        "epoch": p.epoch,
        "samples_in_epoch": p.batch * loop.train.batch_size * loop.strategy.world_size,
        "data": dict(loop.train.identity),  # what that position is a position in
        "data_state": loop.train.state_dict(),  # a stream's own position, where it has one
        "global_batch_size": loop.global_batch,
        "metrics": dict(p.metrics),
        "rng": _rng_state(),
        "callbacks": loop.callbacks.state_dict(),
        "train_window": loop.train_log.state_dict(),  # a collective: every process saves
        "schedule": _schedule_record(loop, _schedule_start(loop)),  # what a resume must continue (or start anew)
        "run_dir": _run_folder(loop),  # its own checkpoints a run always resumes exactly (restarts, requeues)
        # A validation due at this step that a stop signal put off (the resumed run runs it first).
        "validation_due": loop.validation_due == p.step and loop.last_val_step != p.step,
    }


def load_state_dict(loop: Any, checkpoint: dict) -> None:
    """Resume `loop` where `checkpoint` stopped, with this run's optimizer settings; under trainer.resume=new_schedule
    with the configured schedule started afresh at its step, under trainer.resume=weights from its weights alone."""
    # The pre-launch check read the file; this is what every process got (weights: checked there).
    check_checkpoint(loop.cfg.get("ckpt_path"), checkpoint, task_name(loop.task.task), weights=False)
    mode = _resume_mode(loop, checkpoint)
    if mode == "weights":
        _load_weights_only(loop, checkpoint)
        return
    samples = _checked_position(loop, checkpoint)
    load_model(loop, checkpoint, with_optimizer=True)
    configured_groups = [dict(group, params=None) for group in loop.optimizer.param_groups]  # this run's settings
    base_lrs = list(getattr(loop.scheduler, "base_lrs", [g["lr"] for g in configured_groups]))
    _check_same_optimizer(loop.optimizer, checkpoint)
    if mode == "new_schedule":
        loop.optimizer.load_state_dict(checkpoint["optimizer"])  # its moments, at this run's settings from here
        _new_schedule(loop, checkpoint["step"], configured_groups, base_lrs)
    else:
        _continue_schedule(loop, checkpoint)
        _apply_settings(loop.optimizer, loop.scheduler, configured_groups, base_lrs)
    loop.precision.load_state_dict(checkpoint.get("precision", {}))
    if samples:  # mid-epoch in the same data: a stream with a position of its own takes it
        loop.train.load_state_dict(checkpoint.get("data_state", {}))
    per_batch = loop.train.batch_size * loop.strategy.world_size
    loop.progress = Progress(checkpoint["step"], checkpoint["epoch"], samples // per_batch,
                             dict(checkpoint.get("metrics", {})))
    _set_rng_state(checkpoint["rng"])
    loop.callbacks.load_state_dict(checkpoint.get("callbacks", {}))
    loop.train_log.load_state_dict(checkpoint.get("train_window", {}))  # older checkpoints: an empty window
    loop.logger.resume_at(checkpoint["step"] + 1)
    loop.last_val_step = -1
    loop.validation_due = checkpoint["step"] if checkpoint.get("validation_due") else -1


def _checked_position(loop: Any, checkpoint: dict) -> int:
    """The samples into its epoch where this run's data continues, refused when not whole global batches."""
    samples, saved_batch = _data_position(loop, checkpoint), checkpoint.get("global_batch_size")
    if samples % loop.global_batch:  # the first step would train on part of a batch, or skip samples
        raise ConfigError([
            f"trainer.ckpt_path: the checkpoint stopped {samples} samples into epoch {checkpoint['epoch']}, "
            f"which is not a whole number of this run's global batches of {loop.global_batch} (data.batch_size "
            f"{loop.train.batch_size} x {loop.strategy.world_size} process(es) x trainer.accumulate_grad_batches "
            f"{loop.schedule.accumulate}); resume with the checkpoint's global batch ({saved_batch})"
        ])
    if saved_batch is not None and saved_batch != loop.global_batch:
        log.warning("resuming a run trained with a global batch of %d with one of %d: the data continues "
                    "where it stopped, but each step now averages over %d samples", saved_batch,
                    loop.global_batch, loop.global_batch)
    return samples


# -- the schedule on resume: the checkpoint's continued (exact), the configured one from here, or none (weights) --

def _run_folder(loop: Any) -> str:
    return str(Path(loop.run_dir).resolve())


def _schedule_start(loop: Any) -> int:
    """The step this run's schedule started at: 0, or where trainer.resume=new_schedule started it."""
    return getattr(loop, "schedule_start", 0)


def _schedule_record(loop: Any, start: int) -> dict:
    return plan(configured(loop.hparams), start, loop.schedule.total_steps - start)


def _resume_mode(loop: Any, checkpoint: dict) -> str:
    """trainer.resume; a checkpoint this run folder wrote (a restart, a requeue, ckpt_path=last here) is always
    resumed exactly: starting its schedule or its optimizer again would repeat at every restart."""
    mode = loop.cfg.get("resume", "exact")
    if mode != "exact" and checkpoint.get("run_dir") == _run_folder(loop):
        log.warning("trainer.resume=%s takes another run's checkpoint; %s is this run folder's own (a restart, a "
                    "requeue or trainer.ckpt_path=last here): resuming it exactly at step %d",
                    mode, loop.cfg.get("ckpt_path"), checkpoint["step"])
        return "exact"
    return mode


def _load_weights_only(loop: Any, checkpoint: dict) -> None:
    """trainer.resume=weights: the model's weights; optimizer, schedule, data, step and callbacks start afresh."""
    load_model(loop, checkpoint, with_optimizer=False)
    group = loop.optimizer.param_groups[0]
    schedule = getattr(loop.scheduler, "description", None) or described(configured(loop.hparams))
    optimizer = " and ".join(type(o).__name__ for o in optimizers_of(loop.optimizer))
    log.info("trainer.resume=weights: the model's weights of %s (trained %d steps); a new optimizer and schedule "
             "from step 0: %s (lr %g), %s", loop.cfg.get("ckpt_path"), checkpoint["step"], optimizer,
             group.get("initial_lr", group["lr"]), schedule)


def _new_schedule(loop: Any, step: int, configured_groups: list[dict], base_lrs: list[float]) -> None:
    """trainer.resume=new_schedule: the configured scheduler, warm-up included, from `step` over the steps left,
    from the configured optimizer lr and settings."""
    total = loop.schedule.total_steps
    if total - step < 1:
        raise ConfigError([f"trainer.resume=new_schedule: the checkpoint is at step {step} and this run ends at step "
                           f"{total} (trainer.max_steps={loop.cfg.max_steps}): raise trainer.max_steps to train on"])
    for group, settings, base in zip(loop.optimizer.param_groups, configured_groups, base_lrs):
        group.update({key: value for key, value in settings.items() if key != "params"}, lr=base, initial_lr=base)
    restart = getattr(loop.scheduler, "restart", None)
    if restart is not None:  # a schedule the model makes (a LightningModule's configure_optimizers()): made again
        restart(total - step)
        loop.schedule_start = step
        log.info("trainer.resume=new_schedule: a new schedule from step %d over the remaining %d steps: %s", step,
                 total - step, loop.scheduler.description)
        return
    _use_scheduler(loop, _built_scheduler(loop, total - step))
    loop.schedule_start = step
    record, steps = _schedule_record(loop, step), total - step
    told = record["total_steps"]
    note = f" (planned over its scheduler.total_steps={told})" if told not in (None, steps) else ""
    log.info("trainer.resume=new_schedule: a new schedule from step %d: %s over the remaining %d steps%s, lr %g",
             step, described(record["scheduler"]), steps, note, base_lrs[0])


def _continue_schedule(loop: Any, checkpoint: dict) -> None:
    """The checkpoint's schedule where it stopped: refused for another scheduler or settings (named), re-planned
    with a line when this run ends elsewhere than the checkpoint's plan did."""
    problem = unreachable(checkpoint, loop.schedule.total_steps, loop.cfg.get("ckpt_path"))
    if problem:  # found before launch where trainer.max_steps alone ends the run
        raise ConfigError([problem])
    saved, mine = checkpoint.get("schedule"), configured(loop.hparams)
    # Older checkpoints hold no record: taken at their word, as before; nor does a model's own schedule (no scheduler
    # group: a LightningModule's configure_optimizers()), whose state the scheduler's load checks.
    if saved is not None and mine:
        problem = schedule_change(saved["scheduler"], mine, loop.cfg.get("ckpt_path"), checkpoint["step"])
        if problem:
            raise ConfigError([problem])
        start = saved.get("start", 0)
        if start:  # a schedule started at a later step: built again over its steps (before its state loads)
            _use_scheduler(loop, _built_scheduler(loop, loop.schedule.total_steps - start))
        loop.schedule_start = start
        _say_replanned(saved, _schedule_record(loop, start))
    loop.optimizer.load_state_dict(checkpoint["optimizer"])
    _load_scheduler_state(loop, checkpoint["scheduler"])


def _say_replanned(saved: dict, mine: dict) -> None:
    """One line when the checkpoint's schedule was planned to end at another step than this run ends at."""
    before, now, start = saved.get("total_steps"), mine["total_steps"], mine["start"]
    if before is None or now is None or before == now:
        return
    log.warning("trainer.max_steps: the checkpoint's %s was planned over %d optimizer steps (to step %d), this run "
                "ends at step %d: its decay is re-planned to end there from where it stopped (trainer.resume="
                "new_schedule starts the schedule afresh over the remaining steps instead)",
                described(saved["scheduler"]), before, start + before, start + now)


def _load_scheduler_state(loop: Any, state: dict) -> None:
    """A checkpoint of another scheduler's state is one line, not a KeyError or a rate of 0 (older checkpoints)."""
    public = {key for key in loop.scheduler.state_dict() if not key.startswith("_") and key != "verbose"}
    saved = {key for key in state if not key.startswith("_") and key != "verbose"}
    if saved != public:
        raise ConfigError([f"trainer.ckpt_path={loop.cfg.get('ckpt_path')} holds the state of another scheduler "
                           f"({', '.join(sorted(saved))}) than this run's {type(loop.scheduler).__name__} "
                           f"({', '.join(sorted(public))}); resume with the scheduler it was trained with, or set "
                           "trainer.resume=new_schedule to start this one at the checkpoint's step"])
    loop.scheduler.load_state_dict(state)


def _built_scheduler(loop: Any, steps: int) -> Any:
    """The configured scheduler over `steps` optimizer steps, built as the worker builds it (the worker hands the
    loop its builder: the loop never calls the builders itself)."""
    if loop.make_scheduler is None:
        raise ConfigError(["trainer.resume: this loop was given no way to build its scheduler again (Loop's "
                           "make_scheduler), which a schedule started at another step needs"])
    return loop.make_scheduler(steps)


def _use_scheduler(loop: Any, scheduler: Any) -> None:
    loop.scheduler = loop.train_step.scheduler = scheduler


def _data_position(loop: Any, checkpoint: dict) -> int:
    """The samples of its epoch the checkpoint trained on, where this run's data continues: the same position in
    the same data, or the epoch's start under trainer.data_resume=restart."""
    samples, epoch = checkpoint.get("samples_in_epoch", 0), checkpoint["epoch"]
    saved, mine = checkpoint.get("data"), loop.train.identity
    if loop.cfg.get("data_resume", "exact") == "restart":
        log.info("trainer.data_resume=restart: epoch %d of the data starts again from its first batch (the "
                 "checkpoint stopped %d samples into it)", epoch, samples)
        return 0
    if saved is None or saved == mine:  # a checkpoint older than this record is taken at its word
        return samples
    if not samples:
        log.warning("the training data is not what the checkpoint was trained on (%s, now %s); epoch %d starts "
                    "from its first batch", _described(saved), _described(mine), epoch)
        return 0
    raise ConfigError([
        f"trainer.ckpt_path: the checkpoint stopped {samples} samples into epoch {epoch} of {_described(saved)}, "
        f"but this run reads {_described(mine)}, where that position names other samples; resume on the data it "
        f"was trained on, or set trainer.data_resume=restart to start epoch {epoch} of this data from its first "
        "batch"])


def _described(identity: dict) -> str:
    size = identity.get("samples")
    return f"a {identity.get('order')} order of {'unknown length' if size is None else f'{size} samples'}"


def load_weights(loop: Any, checkpoint: dict) -> None:
    """The model's weights and step from a checkpoint, for evaluating or predicting (no training state)."""
    check_checkpoint(loop.cfg.get("ckpt_path"), checkpoint, task_name(loop.task.task), weights=False)
    load_model(loop, checkpoint, with_optimizer=False)
    loop.progress.step, loop.progress.epoch = checkpoint["step"], checkpoint["epoch"]


def load_model(loop: Any, checkpoint: dict, with_optimizer: bool) -> None:
    """The checkpoint's weights into the model: strictly, or, under trainer.strict_loading=false (or a module's own
    `strict_loading = False`, Lightning's setting), without the keys one side lacks, listed in one line (shapes must
    still agree). A resume that takes the optimizer's state too needs the parameters it was saved for."""
    model = loop.strategy.unwrap(loop.wrapped).model
    if loop.cfg.get("strict_loading", True) and getattr(model, "strict_loading", True) is not False:
        model.load_state_dict(checkpoint["model"])
        return
    missing, unexpected = model.load_state_dict(checkpoint["model"], strict=False)
    if not (missing or unexpected):
        return
    params = {name for name, _ in model.named_parameters()}
    saved = sum(len(group.get("params", ())) for group in checkpoint.get("optimizer", {}).get("param_groups", []))
    mine = sum(len(group["params"]) for group in loop.optimizer.param_groups)
    if with_optimizer and (params & set(missing) or saved != mine):
        raise ConfigError([f"trainer.ckpt_path={loop.cfg.get('ckpt_path')}: its optimizer state is of other "
                           f"parameters than this model's (missing {_listed(missing)}; unexpected "
                           f"{_listed(unexpected)}); take its weights alone with trainer.resume=weights"])
    if loop.strategy.is_global_zero:
        log.warning("not strict (trainer.strict_loading=false or the model's strict_loading): %s loaded without %d "
                    "key(s) of the model, kept as built (%s), and %d of the checkpoint, dropped (%s)",
                    loop.cfg.get("ckpt_path"), len(missing), _listed(missing), len(unexpected), _listed(unexpected))


def _listed(keys: list, limit: int = 6) -> str:
    shown = ", ".join(keys[:limit]) or "none"
    return f"{shown} and {len(keys) - limit} more" if len(keys) > limit else shown


def save(loop: Any, periodic: bool) -> None:
    """last.ckpt, and with `periodic` step-N.ckpt too, the oldest removed beyond trainer.keep_last_k."""
    start = time.perf_counter()
    _check_finite_weights(loop)
    folder = loop.run_dir / "checkpoints"
    state = loop.state_dict()
    if periodic:
        new = folder / f"step-{loop.progress.step:06d}.ckpt"
        loop.save_checkpoint(new, state)
        keep = loop.cfg.get("keep_last_k")
        # Counted here, not listed from the disk, where a background write may not have landed yet.
        if loop.periodic is None:
            loop.periodic = list(folder.glob("step-*.ckpt"))
        loop.periodic = sorted({*loop.periodic, new})
        for old in loop.periodic[:-keep] if keep else ():
            loop.remove_checkpoint(old)  # the run's own periodic files, oldest first
        loop.periodic = loop.periodic[-keep:] if keep else loop.periodic
    loop.save_checkpoint(folder / "last.ckpt", state)
    loop.train_log.tick += time.perf_counter() - start  # the log window goes on: a save's time is not training


def check_loadable(loop: Any, state: dict) -> None:
    """A checkpoint holds what a weights-only load reads back: a stream's or a callback's state_dict() that returns
    anything else (an object, a NumPy value) is refused before the file is written, naming whose state it is, so a
    run never writes a checkpoint it could not resume from (the previous one stays as it was)."""
    problem = unloadable(state)
    if problem is None:
        return
    path, _, kind = problem.partition(": ")
    owners = {"data_state.stream": f"{loop.train.what}.state_dict()", "callbacks": "a callback's state_dict()"}
    owner = next((who for prefix, who in owners.items() if path.startswith(prefix)), "the checkpoint's state")
    last = loop.run_dir / "checkpoints" / "last.ckpt"
    kept = f"the last checkpoint written is {last}" if last.exists() else "no checkpoint was written yet"
    raise CheckpointError(f"{owner} holds {kind} (at {path}), which a checkpoint cannot hold: a weights-only load "
                          f"reads tensors, numbers, strings and lists, tuples and dicts of them; return those from it; "
                          f"no checkpoint is written at step {loop.progress.step}, and {kept}")


def saved_before(loop: Any, refused: Exception) -> Exception:
    """A setting refused at a validation (a metric a setting names is not logged): the step before it is whole, so
    last.ckpt is saved first, and the refusal says where (every process refuses alike: the metrics are reduced)."""
    last = loop.run_dir / "checkpoints" / "last.ckpt"
    if loop.schedule.save:
        save(loop, periodic=False)
        loop.strategy.checkpoint_io.wait()  # on disk before the job ends
        where = (f"the training until step {loop.progress.step} is saved in {last}: fix the setting, then resume "
                 f"with trainer.ckpt_path={last}")
    else:
        where = "nothing is saved (trainer.fast_dev_run saves no checkpoints)"
    if isinstance(refused, ConfigError):
        return ConfigError([*refused.problems[:-1], f"{refused.problems[-1]}; {where}"])
    return type(refused)(f"{refused}; {where}")


def _check_finite_weights(loop: Any) -> None:
    """No checkpoint holds a NaN or inf weight: a non-finite gradient (or clipping value) can leave the loss
    finite for a step, and a stop signal saves before the next log step checks it."""
    local = [getattr(p, "to_local", lambda p=p: p)() for p in loop.task.parameters()]
    finite = bool(torch.stack([torch.isfinite(t).all() for t in local]).all()) if local else True
    if not loop.strategy.reduce_boolean_decision(finite, all=True):
        last = loop.run_dir / "checkpoints" / "last.ckpt"
        where = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was saved yet"
        raise NonFiniteLossError(f"the weights became NaN or infinite by step {loop.progress.step}; they are "
                                 f"not saved, and {where}")


def _check_same_optimizer(optimizer: Any, checkpoint: dict) -> None:
    """A checkpoint of another optimizer would load and fail at its first step (a missing hyperparameter)."""
    saved_groups = checkpoint["optimizer"].get("param_groups") or [{}]
    ignored = {"params", "initial_lr", "name"}  # a group's name is no setting (older checkpoints have none)
    saved, mine = set(saved_groups[0]) - ignored, set(optimizer.param_groups[0]) - ignored
    if saved == mine and len(saved_groups) != len(optimizer.param_groups):
        raise ConfigError([f"trainer.ckpt_path: the checkpoint's optimizer has {len(saved_groups)} parameter "
                           f"group(s), this run's {len(optimizer.param_groups)} (optimizer._no_decay_ makes a second "
                           "one); resume with the groups it was trained with"])
    if saved != mine:
        name = checkpoint.get("optimizer_class", "another optimizer")
        raise ConfigError([f"trainer.ckpt_path: the checkpoint holds the state of {name} (settings "
                           f"{', '.join(sorted(saved))}), not of this run's {type(optimizer).__name__} "
                           f"({', '.join(sorted(mine))}); resume with the optimizer it was trained with"])


def _apply_settings(optimizer: Any, scheduler: Any, configured: list[dict], base_lrs: list[float]) -> None:
    """A resumed run follows this run's optimizer settings: a new lr rescales the schedule, other keys are set."""
    changes = []
    for index, (group, settings) in enumerate(zip(optimizer.param_groups, configured)):
        saved_base = scheduler.base_lrs[index] if hasattr(scheduler, "base_lrs") else group["lr"]
        if base_lrs[index] != saved_base:
            changes.append(f"lr {saved_base:g} -> {base_lrs[index]:g}")
            group["lr"] *= base_lrs[index] / saved_base if saved_base else 1.0
            group["initial_lr"] = base_lrs[index]
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs[index] = base_lrs[index]
        for key, value in settings.items():
            if key not in ("params", "lr", "initial_lr") and group.get(key) != value:
                if key != "name":  # the group's name in the logs, not a setting that changed
                    changes.append(f"{key} {group.get(key)} -> {value}")
                group[key] = value
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    if changes:
        log.warning("resumed with this run's optimizer settings, not the checkpoint's: %s", "; ".join(
            dict.fromkeys(changes)))


def _rng_state() -> dict:
    version, state, gauss = random.getstate()
    rng = {"torch": torch.get_rng_state(), "python": [version, list(state), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
