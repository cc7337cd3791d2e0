"""The train metrics of a log step: the step's summed statistics reduced over the processes while the next step
trains, then logged (logger, progress line, `on_train_log`) at the step they were taken.

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
    lr: float
    skipped: int
    extra: dict  # the `metrics` config's train values, computed (a collective) when the log step started


class TrainLog:
    """`start` at a log step (every process, the same step), `collect` later; reads `loop`'s objects at log steps."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.tick = time.perf_counter()  # where the training time the next log covers starts
        self.last_step = -1  # the last step a log was started at
        self._pending: Optional[_PendingLog] = None

    def start(self) -> None:
        """Start reducing the sums since the last log over all processes; every process calls this at the same step.

        The reduction runs while the next step trains; `collect` logs it at the step it was started.
        """
        loop, p = self.loop, self.loop.progress
        sums = loop.train_step.buffer()
        now = time.perf_counter()
        self._pending = _PendingLog(
            reduced=loop.strategy.start_all_reduce(sums, reduce_op="sum"), step=p.step, epoch=p.epoch,
            elapsed=now - self.tick, lr=loop.optimizer.param_groups[0]["lr"], skipped=loop.train_step.guard.skipped,
            extra=loop.metrics.compute("train"))
        self.tick = now
        sums.zero_()
        self.last_step = p.step

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
        metrics.update({"lr": pending.lr, "throughput/samples_per_s": sums["samples"] / seconds,
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
        """Log what is pending, and the last step's sums when no log step ended on it."""
        self.collect()
        if self.last_step != self.loop.progress.step:
            self.start()
            self.collect()

    def _nonfinite_message(self, step: int) -> str:
        last = self.loop.run_dir / "checkpoints" / "last.ckpt"
        where = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was saved yet"
        return (f"the training loss became NaN or infinite before step {step} "
                f"(checked every trainer.log_every_n_steps={self.loop.schedule.log_every} steps); {where}")
