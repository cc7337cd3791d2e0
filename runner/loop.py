"""The fixed training loop: it calls the injected strategy, precision, logger and checkpoint objects, nothing else."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from runner.callbacks import Callbacks
from runner.checkpoint_io.trust import check as check_checkpoint, task_name
from runner.config import DEFAULT_EPOCHS, ConfigError
from runner.flops import StepFlops
from runner.heartbeat import NoHeartbeat
from runner.metrics import MetricSet
from runner.tasks.base import StepWeights, plural

log = logging.getLogger("runner")

PROGRESS_LOG_S = 10.0  # without a terminal, progress goes to the log this often (log_every_n_steps=1 stays cheap)


class NonFiniteLossError(RuntimeError):
    pass


class NonFiniteGuard:
    """`trainer.skip_nonfinite_loss`: drop micro-batches whose loss was NaN/inf on any process, and skip
    the optimizer step they belong to.

    Enabled, it costs one tiny all-reduce and host sync per micro-batch; disabled, it does nothing per
    step, and a non-finite loss stops the run just after the next log step (a NaN poisons the loss sum).
    """

    def __init__(self, strategy: Any, enabled: bool, gradients: bool = True) -> None:
        self.strategy, self.enabled, self.skipped = strategy, enabled, 0
        self.gradients = gradients  # False when the precision skips such steps itself (a loss scaler)
        self._window_bad = False

    def check(self, loss: torch.Tensor) -> bool:
        """True when this micro-batch's loss is not finite on some process (always False when disabled)."""
        if not self.enabled:
            return False
        flag = (~torch.isfinite(loss.detach())).double()
        bad = bool(self.strategy.all_reduce(flag, reduce_op="sum") > 0)
        self._window_bad |= bad
        return bad

    def skip_step(self) -> bool:
        """True when the accumulation window that just ended held a non-finite loss."""
        bad, self._window_bad = self._window_bad, False
        self.skipped += bad
        return bad

    def skip_gradients(self, parameters: Any) -> bool:
        """True when a gradient is NaN/inf on some process though the losses were finite: the step is skipped."""
        if not (self.enabled and self.gradients):
            return False
        grads = [getattr(p.grad, "to_local", lambda g=p.grad: g)() for p in parameters if p.grad is not None]
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        bad = bool(self.strategy.all_reduce((~finite).double(), reduce_op="sum") > 0)
        self.skipped += bad
        return bad


class StopVote:
    """Processes agree to stop at one step: each step starts a reduction of the signal each process got (0: none),
    read at the next step, so a stop comes at most two steps after the signal, whatever the log interval."""

    def __init__(self, strategy: Any, requested: Callable[[], int]) -> None:
        self.strategy, self.requested = strategy, requested
        self._pending: Optional[Callable[[], int]] = None

    def __call__(self) -> int:
        """The signal some process got (the highest number when several), once every process knows it."""
        if self.strategy.world_size == 1:
            return int(self.requested())
        agreed = self.drain()
        if not agreed:
            self._pending = self.strategy.start_any_signal(int(self.requested()))
        return agreed

    def drain(self) -> int:
        pending, self._pending = self._pending, None
        return pending() if pending is not None else 0


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch: int = 0  # micro-batches this process has trained on in the current epoch
    metrics: dict = field(default_factory=dict)


@dataclass
class _PendingLog:
    """A log step's metric sums on their way through the all-reduce, with what it read at that step."""

    reduced: Callable[[], torch.Tensor]
    step: int
    epoch: int
    elapsed: float  # seconds of training the sums cover
    lr: float
    skipped: int
    extra: dict  # the `metrics` config's train values, computed (a collective) when the log step started


@dataclass
class Schedule:
    """When things happen, derived once from `trainer.*` and the loader length."""

    batches_per_epoch: int
    accumulate: int
    max_steps: float
    max_epochs: float
    log_every: int
    val_every: int
    val_batches: float
    ckpt_every: float
    save: bool
    steps_decide: bool  # trainer.max_steps set, trainer.max_epochs not: the steps alone end the run

    @property
    def total_steps(self) -> int:
        """The optimizer steps the run takes from step 0 (what schedulers decay over)."""
        return int(min(self.max_steps, self.max_epochs * (self.batches_per_epoch // self.accumulate)))


def make_schedule(t: Any, train_batches: int, val_batches: int) -> Schedule:
    dev_run = int(t.fast_dev_run)  # true -> 1
    limit = _limit(t.limit_train_batches, train_batches)
    accumulate = t.accumulate_grad_batches
    batches = max(dev_run, 0) if dev_run else limit
    batches = min(batches, train_batches) // accumulate * accumulate
    steps_per_epoch = max(batches // accumulate, 1)
    interval = t.val_check_interval
    val_every = interval if isinstance(interval, int) else max(1, int(interval * steps_per_epoch))
    steps_decide = t.max_epochs is None and t.max_steps != -1
    epochs = DEFAULT_EPOCHS if t.max_epochs is None and not steps_decide else t.max_epochs
    return Schedule(
        batches_per_epoch=batches,
        accumulate=accumulate,
        max_steps=dev_run or (math.inf if t.max_steps == -1 else t.max_steps),
        max_epochs=1 if dev_run else (math.inf if epochs in (-1, None) else epochs),
        log_every=1 if dev_run else t.log_every_n_steps,
        val_every=val_every,
        val_batches=dev_run or _limit(t.limit_val_batches, val_batches),
        ckpt_every=math.inf if dev_run or t.ckpt_every_n_steps is None else t.ckpt_every_n_steps,
        save=not dev_run,
        steps_decide=steps_decide and not dev_run,
    )


def _limit(value: Any, total: int) -> int:
    return min(value, total) if isinstance(value, int) else int(value * total)


class Loop:
    """Trains `task` (wrapped by the strategy) until max_steps or max_epochs, validating and checkpointing."""

    heartbeat: Any = NoHeartbeat()  # a launched worker's beats (runner.heartbeat.attach)

    def __init__(self, strategy: Any, task: Any, wrapped: Any, optimizer: Any, scheduler: Any, train: Any,
                 val: Any, logger: Any, trainer_cfg: Any, run_dir: Path, stop_requested: Callable[[], int],
                 hparams: dict, metrics: Optional[MetricSet] = None, callbacks: Optional[Callbacks] = None) -> None:
        self.strategy, self.task, self.wrapped = strategy, task, wrapped  # task: the TaskModule strategies wrap
        self.precision = strategy.precision
        self.optimizer, self.scheduler, self.train, self.val, self.logger = optimizer, scheduler, train, val, logger
        self.cfg, self.run_dir, self.hparams = trainer_cfg, run_dir, hparams
        self.schedule = make_schedule(trainer_cfg, len(train), len(val) if val is not None else 0)
        self.progress = Progress()
        self.global_batch = train.batch_size * strategy.world_size * self.schedule.accumulate
        self.metrics = metrics or MetricSet({}, strategy)
        self.callbacks = callbacks or Callbacks()
        self._signalled = 0  # the signal some process got: stop now, skip the final validation
        self.stop_vote = StopVote(strategy, stop_requested)
        self._stop_reason: Optional[str] = None  # a callback asked to end the run (early stopping)
        self.weights = StepWeights(task.task, strategy, train.batch_size, self.schedule.accumulate)
        self._sums: Optional[torch.Tensor] = None  # the task's statistics since the last log step
        self._names: tuple[str, ...] = ()
        self.clip = trainer_cfg.gradient_clip_val  # read once: a DictConfig look-up per step costs
        self._show_progress = strategy.is_global_zero and _interactive()
        self._progress_open = False
        self._last_progress_log = -math.inf
        self.guard = NonFiniteGuard(strategy, bool(trainer_cfg.get("skip_nonfinite_loss", False)),
                                    gradients=not self.precision.skips_nonfinite_steps)
        self._last_val_step = -1
        self._last_log_step = -1
        self._pending: _PendingLog | None = None
        self._periodic: Optional[list[Path]] = None  # the step-N checkpoints on disk or being written
        self.flops = StepFlops(strategy, task, wrapped, train.batch_size, trainer_cfg.get("peak_tflops"))

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            return self._run()
        except BaseException as error:
            self.callbacks.call("on_exception", self, error)
            raise

    def _run(self) -> dict:
        s, p = self.schedule, self.progress
        if s.batches_per_epoch < 1:
            raise ConfigError([self._too_few_batches()])
        self._announce()
        self.callbacks.call("on_fit_start", self)
        self._tick = time.perf_counter()
        stopped = False
        while p.step < s.max_steps and p.epoch < s.max_epochs and not stopped:
            self.train.sampler.set_epoch(p.epoch)
            self.train.sampler.start_batch = p.batch
            self.task.train()
            batches = iter(self.train)
            while p.batch < s.batches_per_epoch and not stopped and p.step < s.max_steps:
                self.heartbeat.step(p.step)  # the launcher's stall watch sees this process advance
                window = list(itertools.islice(batches, s.accumulate))  # the micro-batches of one optimizer step
                if len(window) < s.accumulate:  # a loader shorter than it said: the epoch is over
                    p.batch = s.batches_per_epoch
                    break
                if self.flops.pending:  # once, on the meta device; its seconds are no step's
                    self._tick += self.flops.count(window)
                p.batch += s.accumulate
                self._train_step(window)
                stopped = self._after_step()
            if p.batch >= s.batches_per_epoch:
                p.epoch, p.batch = p.epoch + 1, 0
        return self._finish()

    def request_stop(self, reason: str) -> None:
        """End the run after this step's checkpoint (every process must ask at the same step)."""
        self._stop_reason = reason

    def _train_step(self, window: list) -> None:
        """Forward and backward each micro-batch of one optimizer step (gradients synced on the last), then step.

        Each micro-batch's loss is a sum over its units; `weights` scales it so that the step follows the
        mean over every unit of the global batch, whatever its split over processes and micro-batches.
        """
        scale, stats, last = self.weights.start(window), [], len(window) - 1
        for index, batch in enumerate(window):
            with self.strategy.backward_sync(self.wrapped, enabled=index == last):
                out = self.strategy.training_step(self.wrapped, self.strategy.batch_to_device(batch),
                                                  self.metrics.wants("train"))
                loss = self.task.batch_loss(out)
                self.precision.backward(loss * scale())
            if not self.guard.check(loss):
                self._accumulate(out)
                self.metrics.update("train", out)
            stats.append(out["stats"])
        if not self.guard.skip_step():
            self.precision.unscale_gradients(self.optimizer)
            self.weights.finish(self.task.parameters(), stats)
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.task.parameters(), self.clip)
            if not self.guard.skip_gradients(self.task.parameters()):
                self.precision.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.progress.step += 1

    def _buffer(self) -> torch.Tensor:
        """The task's statistics summed since the last log step (made at the first use, once the task knows
        its columns)."""
        if self._sums is None:
            self._names = self.task.task.stat_names
            self._sums = torch.zeros(len(self._names), dtype=torch.float64, device=self.strategy.root_device)
        return self._sums

    def _accumulate(self, out: dict) -> None:
        """Add a micro-batch's sums on the device: no host sync until the next log step."""
        self._buffer().add_(out["stats"].sum(dim=0))

    def _after_step(self) -> bool:
        """Log, validate and checkpoint when due. Returns True when the run must stop (a signal or a callback)."""
        s, step = self.schedule, self.progress.step
        self._signalled = self.stop_vote()
        self._collect_log()  # the last log step's sums, reduced while this step trained
        periodic = step % s.ckpt_every == 0
        if step % s.log_every == 0 or periodic or self._signalled:
            self._start_log()
        validate = step % s.val_every == 0 and not self._signalled
        if validate or periodic or self._signalled:
            self._collect_log()  # a step's train line comes before its val line and its checkpoint
        if validate:
            self._validate()  # callbacks may ask to stop here
        stop = self._signalled or self._stop_reason is not None
        if s.save and (periodic or stop):
            self._save(periodic=periodic)
        return stop

    # -- metrics ------------------------------------------------------------------------------------
    def _start_log(self) -> None:
        """Start reducing the sums since the last log over all processes; every process calls this at the same step.

        The reduction runs while the next step trains; `_collect_log` logs it at the step it was started.
        """
        sums = self._buffer()
        now = time.perf_counter()
        self._pending = _PendingLog(
            reduced=self.strategy.start_all_reduce(sums, reduce_op="sum"), step=self.progress.step,
            epoch=self.progress.epoch, elapsed=now - self._tick, lr=self.optimizer.param_groups[0]["lr"],
            skipped=self.guard.skipped, extra=self.metrics.compute("train"))
        self._tick = now
        sums.zero_()
        self._last_log_step = self.progress.step

    def _collect_log(self) -> None:
        """Log the reduction `_start_log` started, if any."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        sums = dict(zip(self._names, pending.reduced().tolist()))
        if not math.isfinite(sums["loss"]):
            raise NonFiniteLossError(self._nonfinite_message(pending.step))
        if not sums["samples"]:  # nothing trained since the last log (all skipped): keep the last values
            return
        seconds = max(pending.elapsed, 1e-9)
        metrics = {f"train/{name}": value for name, value in self.task.task.compute(sums).items()}
        metrics.update({"lr": pending.lr, "throughput/samples_per_s": sums["samples"] / seconds,
                        f"throughput/{plural(self.task.task.unit)}_per_s": sums["units"] / seconds, **pending.extra})
        metrics.update(self.flops.metrics(sums["samples"], seconds))
        if self.guard.enabled:
            metrics["train/skipped_steps"] = float(pending.skipped)
        self.progress.metrics.update(metrics)
        self.logger.log_metrics(metrics, pending.step)
        if self.strategy.is_global_zero:
            self._print_progress(metrics, pending.step, pending.epoch)
        self.callbacks.call("on_train_log", self, metrics, pending.step)

    def _validate(self) -> None:
        if self.val is None or self._last_val_step == self.progress.step:
            return
        start = time.perf_counter()
        metrics = self.evaluate("val", self.val, self.schedule.val_batches)
        self._last_val_step = self.progress.step
        if metrics:
            self.callbacks.call("on_validation_end", self, {**self.progress.metrics, **metrics}, self.progress.step)
        self._tick += time.perf_counter() - start  # validation time is not training throughput

    def evaluate(self, prefix: str, loader: Any, limit: float = math.inf) -> dict:
        """The task's metrics and the `metrics` config's over `loader` (every sample once over the processes),
        logged as `<prefix>/<name>` at the current step; every process calls it."""
        start, task, preds = time.perf_counter(), self.task.task, self.metrics.wants("val")
        self.task.eval()
        names = task.stat_names
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.strategy.root_device)
        with torch.no_grad():
            for index, batch in enumerate(loader):
                if index >= limit:
                    break
                out = self.strategy.validation_step(self.wrapped, self.strategy.batch_to_device(batch), preds)
                sums += out["stats"].sum(dim=0)
                self.metrics.update("val", out)
        self.task.train()
        totals = dict(zip(names, self.strategy.all_reduce(sums, reduce_op="sum").tolist()))
        extra = self.metrics.compute("val", prefix)  # every process, even one without a sample
        if not totals["samples"]:
            return {}
        metrics = {**{f"{prefix}/{name}": value for name, value in task.compute(totals).items()}, **extra}
        self.progress.metrics.update(metrics)
        self.logger.log_metrics(metrics, self.progress.step)
        self._end_progress()
        log.info("step %d  %s  (%d samples, %.2fs)", self.progress.step, _fmt(metrics), totals["samples"],
                 time.perf_counter() - start)
        return metrics

    def predict(self, loader: Any) -> list:
        """The model's predictions for every sample of `loader`, in the data set's order (on rank 0; [] elsewhere).

        Rank r of W predicts samples r, r+W, ...; rank 0 gathers every rank's share and interleaves them.
        """
        mine: list[torch.Tensor] = []
        self.task.eval()
        module = self.strategy.unwrap(self.wrapped)
        with torch.no_grad():
            for batch in loader:
                mine += [p.cpu() for p in module.predict(self.strategy.batch_to_device(batch)).unbind(0)]
        self.task.train()
        shares = [self.strategy.broadcast(mine if rank == self.strategy.global_rank else None, src=rank)
                  for rank in range(self.strategy.world_size)]
        if not self.strategy.is_global_zero:
            return []
        world = len(shares)
        return [shares[index % world][index // world] for index in range(sum(len(share) for share in shares))]

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        p = self.progress
        return {
            "model": self.strategy.unwrap(self.wrapped).model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "optimizer_class": type(self.optimizer).__name__,
            "task": task_name(self.task.task),  # a checkpoint of another task is refused by name
            "step": p.step,
            "epoch": p.epoch,
            "samples_in_epoch": p.batch * self.train.batch_size * self.strategy.world_size,
            "global_batch_size": self.global_batch,
            "metrics": dict(p.metrics),
            "rng": _rng_state(),
            "callbacks": self.callbacks.state_dict(),
        }

    def load_state_dict(self, checkpoint: dict) -> None:
        # The pre-launch check read the file; this is what every process got (weights: checked there).
        check_checkpoint(self.cfg.get("ckpt_path"), checkpoint, task_name(self.task.task), weights=False)
        per_batch = self.train.batch_size * self.strategy.world_size
        samples, saved_batch = checkpoint.get("samples_in_epoch", 0), checkpoint.get("global_batch_size")
        if samples % self.global_batch:  # the first step would train on part of a batch, or skip samples
            raise ConfigError([
                f"trainer.ckpt_path: the checkpoint stopped {samples} samples into epoch {checkpoint['epoch']}, "
                f"which is not a whole number of this run's global batches of {self.global_batch} (data.batch_size "
                f"{self.train.batch_size} x {self.strategy.world_size} process(es) x trainer.accumulate_grad_batches "
                f"{self.schedule.accumulate}); resume with the checkpoint's global batch ({saved_batch})"
            ])
        if saved_batch is not None and saved_batch != self.global_batch:
            log.warning("resuming a run trained with a global batch of %d with one of %d: the data continues "
                        "where it stopped, but each step now averages over %d samples", saved_batch,
                        self.global_batch, self.global_batch)
        self.strategy.unwrap(self.wrapped).model.load_state_dict(checkpoint["model"])
        configured = [dict(group, params=None) for group in self.optimizer.param_groups]  # this run's settings
        base_lrs = list(getattr(self.scheduler, "base_lrs", [g["lr"] for g in configured]))
        _check_same_optimizer(self.optimizer, checkpoint)
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        _apply_settings(self.optimizer, self.scheduler, configured, base_lrs)
        self.precision.load_state_dict(checkpoint.get("precision", {}))
        self.progress = Progress(checkpoint["step"], checkpoint["epoch"], samples // per_batch,
                                 dict(checkpoint.get("metrics", {})))
        _set_rng_state(checkpoint["rng"])
        self.callbacks.load_state_dict(checkpoint.get("callbacks", {}))
        self.logger.resume_at(checkpoint["step"] + 1)
        self._last_val_step = -1

    def load_weights(self, checkpoint: dict) -> None:
        """The model's weights and step from a checkpoint, for evaluating or predicting (no training state)."""
        check_checkpoint(self.cfg.get("ckpt_path"), checkpoint, task_name(self.task.task), weights=False)
        self.strategy.unwrap(self.wrapped).model.load_state_dict(checkpoint["model"])
        self.progress.step, self.progress.epoch = checkpoint["step"], checkpoint["epoch"]

    def write_result(self, result: dict) -> None:
        """metrics.json (rank 0)."""
        if self.strategy.is_global_zero:
            _write_json(self.run_dir / "metrics.json", result)

    def save_checkpoint(self, path: Path, state: Optional[dict] = None) -> None:
        """Write the run's state to `path` (rank 0, through the checkpoint IO); every process calls it."""
        state = self.state_dict() if state is None else state
        self.callbacks.call("on_save_checkpoint", self, state)
        self.strategy.save_checkpoint(state, path)
        self.callbacks.call("on_checkpoint_saved", self, path)

    def remove_checkpoint(self, path: Path) -> None:
        """Remove one of this run's checkpoint files (rank 0, after the checkpoint IO's pending writes)."""
        self.strategy.remove_checkpoint(path)

    def _save(self, periodic: bool) -> None:
        self._check_finite_weights()
        folder = self.run_dir / "checkpoints"
        state = self.state_dict()
        if periodic:
            new = folder / f"step-{self.progress.step:06d}.ckpt"
            self.save_checkpoint(new, state)
            keep = self.cfg.get("keep_last_k")
            # Counted here, not listed from the disk, where a background write may not have landed yet.
            if self._periodic is None:
                self._periodic = list(folder.glob("step-*.ckpt"))
            self._periodic = sorted({*self._periodic, new})
            for old in self._periodic[:-keep] if keep else ():
                self.remove_checkpoint(old)  # the run's own periodic files, oldest first
            self._periodic = self._periodic[-keep:] if keep else self._periodic
        self.save_checkpoint(folder / "last.ckpt", state)

    def _check_finite_weights(self) -> None:
        """No checkpoint holds a NaN or inf weight: a non-finite gradient (or clipping value) can leave the loss
        finite for a step, and a stop signal saves before the next log step checks it."""
        local = [getattr(p, "to_local", lambda p=p: p)() for p in self.task.parameters()]
        finite = bool(torch.stack([torch.isfinite(t).all() for t in local]).all()) if local else True
        if not self.strategy.reduce_boolean_decision(finite, all=True):
            last = self.run_dir / "checkpoints" / "last.ckpt"
            where = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was saved yet"
            raise NonFiniteLossError(f"the weights became NaN or infinite by step {self.progress.step}; they are "
                                     f"not saved, and {where}")

    # -- start and end ------------------------------------------------------------------------------
    def _finish(self) -> dict:
        p = self.progress
        self._signalled = self._signalled or self.stop_vote.drain()
        self._collect_log()
        if self._last_log_step != p.step:
            self._start_log()
            self._collect_log()
        if not self._signalled:  # a signal stops at once; early stopping has validated this step already
            self._validate()
        if self.schedule.save:
            self._save(periodic=False)
        result = {**p.metrics, "step": p.step, "epoch": p.epoch, "stopped_early": bool(self._signalled)}
        if self._signalled:
            result["stop_signal"] = self._signalled
        if self._stop_reason is not None:
            result["stopped_by"] = self._stop_reason
            log.info("stopped at step %d by %s", p.step, self._stop_reason)
        self.callbacks.call("on_fit_end", self, result)
        self.strategy.checkpoint_io.wait()  # metrics.json never names a step whose checkpoint is not on disk
        if self.strategy.is_global_zero:
            final = {k: v for k, v in result.items() if isinstance(v, float)}
            self.logger.log_hyperparams(self.hparams, final)
            _write_json(self.run_dir / "metrics.json", result)
            self._end_progress()
            log.info("done: %s", _fmt(result))
        self.strategy.barrier("finish")
        return result

    def _announce(self) -> None:
        s, p = self.schedule, self.progress
        log.info("global batch %d = data.batch_size %d x %d process(es) x accumulate %d; %d optimizer steps "
                 "per epoch; starting at step %d (epoch %d, batch %d)", self.global_batch, self.train.batch_size,
                 self.strategy.world_size, s.accumulate, s.batches_per_epoch // s.accumulate, p.step, p.epoch,
                 p.batch)
        if s.steps_decide:
            log.info("trainer.max_steps=%d decides the length (trainer.max_epochs is not set): %d epoch(s) of "
                     "data", self.cfg.max_steps, math.ceil(s.max_steps / max(s.batches_per_epoch // s.accumulate, 1)))
        if p.step >= s.max_steps or p.epoch >= s.max_epochs:
            log.warning("nothing to train: the run is already at step %d, epoch %d (trainer.max_steps=%s, "
                        "trainer.max_epochs=%s); raise them to continue", p.step, p.epoch,
                        self.cfg.max_steps, self.cfg.max_epochs)

    def _too_few_batches(self) -> str:
        return (f"no full global batch per epoch: the training set gives {len(self.train)} batch(es) of "
                f"data.batch_size={self.train.batch_size} per process with {self.strategy.world_size} process(es), "
                f"fewer than trainer.accumulate_grad_batches={self.schedule.accumulate} or limited to zero by "
                "trainer.limit_train_batches; use more samples or a smaller batch")

    def _nonfinite_message(self, step: int) -> str:
        last = self.run_dir / "checkpoints" / "last.ckpt"
        where = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was saved yet"
        return (f"the training loss became NaN or infinite before step {step} "
                f"(checked every trainer.log_every_n_steps={self.schedule.log_every} steps); {where}")

    def _print_progress(self, metrics: dict, step: int, epoch: int) -> None:
        """A terminal gets one line rewritten at every log step; a log file one line every PROGRESS_LOG_S."""
        s = self.schedule
        total = min(s.max_steps, s.max_epochs * (s.batches_per_epoch // s.accumulate))
        now = time.monotonic()
        if not self._show_progress and now - self._last_progress_log < PROGRESS_LOG_S and step < total:
            return
        rate = metrics["throughput/samples_per_s"] / self.global_batch
        eta = (total - step) / rate if rate and total < math.inf else float("nan")
        line = (f"step {step}/{total if total < math.inf else '?'}  epoch {epoch}  "
                f"loss {metrics['train/loss']:.4f}  {metrics['throughput/samples_per_s']:.0f} samples/s  "
                f"eta {eta:.0f}s")
        if not self._show_progress:
            log.info(line)
            self._last_progress_log = now
            return
        sys.stderr.write(f"\r{line}\033[K")  # rewrite the same terminal line; \033[K clears its tail
        sys.stderr.flush()
        self._progress_open = True

    def _end_progress(self) -> None:
        """Move past the progress line before anything else is printed."""
        if self._progress_open:
            sys.stderr.write("\n")
            self._progress_open = False
        self._last_progress_log = -math.inf


def _check_same_optimizer(optimizer: Any, checkpoint: dict) -> None:
    """A checkpoint of another optimizer would load and fail at its first step (a missing hyperparameter)."""
    saved_groups = checkpoint["optimizer"].get("param_groups") or [{}]
    saved, mine = set(saved_groups[0]) - {"params", "initial_lr"}, set(optimizer.param_groups[0]) - {"params",
                                                                                                 "initial_lr"}
    if saved != mine or len(saved_groups) != len(optimizer.param_groups):
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
                changes.append(f"{key} {group.get(key)} -> {value}")
                group[key] = value
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    if changes:
        log.warning("resumed with this run's optimizer settings, not the checkpoint's: %s", "; ".join(
            dict.fromkeys(changes)))


def _interactive() -> bool:
    return os.isatty(2) and os.environ.get("TERM") != "dumb"


def _fmt(metrics: dict) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


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


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
