"""The train metrics of a log window: the steps since the previous log step (at most trainer.log_every_n_steps),
their summed statistics reduced over the processes while the next step trains, then logged (logger, progress,
`on_train_log`) at the step they were taken. A checkpoint carries the open window, so a resumed run logs what
an uninterrupted run logs.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the loop starts a log at
log steps and collects it at the next step, or at once before a validation or a checkpoint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from runner.loop.step import NonFiniteLossError
from runner.tasks.base import plural


@dataclass
class _PendingLog:
    """A log step's metric sums on their way through the all-reduce, with what it read at that step."""

    reduced: Callable[[], torch.Tensor]
    step: int
    epoch: int
    elapsed: float  # seconds of training the sums cover
    lrs: list  # each param group's learning rate in the window's last step
    skipped: int
    extra: dict  # the `metrics` config's train values, computed (a collective) when the log step started


class TrainLog:
    """`start` at a log step (every process, the same step), `collect` later; reads `loop`'s objects at log steps."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.tick = time.perf_counter()  # where the training time the open window covers starts
        self.window_start = 0  # the step the open window follows (the last log step, or where training started)
        self.last_step = -1  # the last step whose train metrics were logged
        self._pending: Optional[_PendingLog] = None
        self._carried: dict = {}  # the open window's sums a checkpoint brought (rank 0), added at their first use
        self._carried_seconds = 0.0

    def begin(self) -> None:
        """Training starts (or resumes) now: the clock of the open window runs from here."""
        self.tick = time.perf_counter() - self._carried_seconds
        self._carried_seconds = 0.0

    def start(self, close: bool = True) -> None:
        """Start reducing the open window's sums over all processes; every process calls this at the same step.

        The reduction runs while the next step trains; `collect` logs it at the step it was started. With
        `close=False` the window stays open (the end of a run: its checkpoint carries the window on).
        """
        loop, p = self.loop, self.loop.progress
        sums = self._sums()
        now, lrs = time.perf_counter(), loop.train_step.lrs or [group["lr"] for group in loop.optimizer.param_groups]
        self._pending = _PendingLog(
            reduced=loop.strategy.start_all_reduce(sums, reduce_op="sum"), step=p.step, epoch=p.epoch,
            elapsed=now - self.tick, lrs=lrs,
            skipped=loop.train_step.guard.skipped, extra=loop.metrics.compute("train"))
        self.last_step = p.step
        if close:
            self.tick, self.window_start = now, p.step
            sums.zero_()

    def collect(self) -> None:
        """Log the reduction `start` started, if any."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        loop, task = self.loop, self.loop.task.task
        sums = dict(zip(loop.train_step.names, pending.reduced().tolist()))
        if not math.isfinite(sums["loss"]):
            raise NonFiniteLossError(self._nonfinite_message(pending.step))
        if not sums["samples"]:  # nothing trained since the last log (all skipped): keep the last values
            return
        seconds = max(pending.elapsed, 1e-9)
        metrics = {f"train/{name}": value for name, value in task.compute(sums).items()}
        metrics.update({**_lr_metrics(loop.optimizer.param_groups, pending.lrs),
                        "throughput/samples_per_s": sums["samples"] / seconds,
                        f"throughput/{plural(task.unit)}_per_s": sums["units"] / seconds, **pending.extra})
        metrics.update(loop.flops.metrics(sums["samples"], seconds))
        if loop.train_step.guard.enabled:
            metrics["train/skipped_steps"] = float(pending.skipped)
        loop.progress.metrics.update(metrics)
        loop.logger.log_metrics(metrics, pending.step)
        if loop.strategy.is_global_zero:
            loop.console.progress(metrics, pending.step, pending.epoch)
        loop.callbacks.call("on_train_log", loop, metrics, pending.step)

    def finish(self) -> None:
        """Log what is pending, and the open window when no log step ended on the last step (the window stays
        open: the run's last checkpoint carries it, for a run that continues from there)."""
        self.collect()
        if self.last_step != self.loop.progress.step:
            self.start(close=False)
            self.collect()

    def state_dict(self) -> dict:
        """The open window for a checkpoint: its sums over all processes, seconds and steps. Every process calls
        this at the same step (a collective); a window whose loss is NaN or infinite is never saved."""
        loop, step = self.loop, self.loop.progress.step
        seconds, steps = time.perf_counter() - self.tick, step - self.window_start
        if loop.train_step.sums is None:  # no step trained yet: at most what a checkpoint brought
            return {"sums": dict(self._carried), "seconds": seconds, "steps": steps}
        sums = dict(zip(loop.train_step.names, loop.strategy.all_reduce(self._sums(), reduce_op="sum").tolist()))
        if not math.isfinite(sums["loss"]):
            raise NonFiniteLossError(self._nonfinite_message(step))
        return {"sums": sums, "seconds": seconds, "steps": steps}

    def load_state_dict(self, window: dict) -> None:
        """Continue the window a checkpoint carried (a checkpoint without one: an empty window at its step).

        Rank 0 alone adds the sums, which hold every process's already: the next reduction counts them once.
        """
        self._carried = dict(window.get("sums", {})) if self.loop.strategy.is_global_zero else {}
        self._carried_seconds = float(window.get("seconds", 0.0))
        self.window_start = self.loop.progress.step - int(window.get("steps", 0))
        self.last_step = self.loop.progress.step  # the run that saved it logged there, or logs the window later

    def _sums(self) -> torch.Tensor:
        """The open window's sums on this process, with those a checkpoint carried added at their first use."""
        sums = self.loop.train_step.buffer()
        if self._carried:
            names = self.loop.train_step.names
            sums += torch.tensor([float(self._carried.get(name, 0.0)) for name in names], dtype=sums.dtype,
                                 device=sums.device)
            self._carried = {}
        return sums

    def _nonfinite_message(self, step: int) -> str:
        last = self.loop.run_dir / "checkpoints" / "last.ckpt"
        where = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was saved yet"
        return (f"the training loss became NaN or infinite before step {step} "
                f"(checked every trainer.log_every_n_steps={self.loop.schedule.log_every} steps and at each "
                f"checkpoint); {where}")


def _lr_metrics(groups: list, lrs: list) -> dict:
    """`lr` (the first param group's, as dashboards read it) and, with several groups, `lr/<name or index>`."""
    metrics = {"lr": lrs[0]}
    if len(lrs) > 1:
        metrics.update({f"lr/{group.get('name', index)}": lr for index, (group, lr) in enumerate(zip(groups, lrs))})
    return metrics
