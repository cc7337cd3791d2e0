"""When things happen and where the run is: the loop's plan, derived once from `trainer.*` and the loader length.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the worker also reads the
plan before the loop exists (schedulers decay over `Schedule.total_steps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runner.config import DEFAULT_EPOCHS, ConfigError


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch: int = 0  # micro-batches this process has trained on in the current epoch
    metrics: dict = field(default_factory=dict)


@dataclass
class Schedule:
    """When things happen, derived once from `trainer.*` and the loader length."""

    batches_per_epoch: float  # math.inf: a stream that does not say its length (its epoch ends when it does)
    accumulate: int
    max_steps: float
    max_epochs: float
    log_every: int
    val_every: int
    val_batches: float
    ckpt_every: float
    save: bool
    steps_decide: bool  # trainer.max_steps set, trainer.max_epochs not: the steps alone end the run
    val_each_epoch: bool = False  # validate when an epoch of unknown length ends (val_check_interval=1.0)

    @property
    def total_steps(self) -> int:
        """The optimizer steps the run takes from step 0 (what schedulers decay over)."""
        return int(min(self.max_steps, self.max_epochs * _whole(self.batches_per_epoch, self.accumulate)))


def make_schedule(t: Any, train_batches: float, val_batches: float) -> Schedule:
    """The plan for `train_batches` per epoch (math.inf: a stream of unknown length) and `val_batches`."""
    dev_run = int(t.fast_dev_run)  # true -> 1
    limit = _limit(t.limit_train_batches, train_batches, "trainer.limit_train_batches")
    accumulate = t.accumulate_grad_batches
    batches = max(dev_run, 0) if dev_run else limit
    batches = _whole(min(batches, train_batches), accumulate) * accumulate
    steps_per_epoch = max(_whole(batches, accumulate), 1)
    interval = t.val_check_interval
    unknown = steps_per_epoch == math.inf and not isinstance(interval, int)
    if unknown and interval != 1.0:
        raise ConfigError([f"trainer.val_check_interval={interval} is a fraction of an epoch, but the training "
                           "stream does not say its length; give a number of steps, or 1.0 (each epoch's end)"])
    val_every = (interval if isinstance(interval, int) else math.inf if unknown
                 else max(1, int(interval * steps_per_epoch)))
    steps_decide = t.max_epochs is None and t.max_steps != -1
    if train_batches == math.inf and t.max_steps == -1 and not dev_run:
        raise ConfigError(["trainer.max_steps=-1: the training stream does not say its length, so the run's length "
                           "(and the schedulers' decay) needs trainer.max_steps"])
    epochs = DEFAULT_EPOCHS if t.max_epochs is None and not steps_decide else t.max_epochs
    return Schedule(
        batches_per_epoch=batches,
        accumulate=accumulate,
        max_steps=dev_run or (math.inf if t.max_steps == -1 else t.max_steps),
        max_epochs=1 if dev_run else (math.inf if epochs in (-1, None) else epochs),
        log_every=1 if dev_run else t.log_every_n_steps,
        val_every=val_every,
        val_batches=dev_run or _limit(t.limit_val_batches, val_batches, "trainer.limit_val_batches"),
        ckpt_every=math.inf if dev_run or t.ckpt_every_n_steps is None else t.ckpt_every_n_steps,
        save=not dev_run,
        steps_decide=steps_decide and not dev_run,
        val_each_epoch=unknown and not dev_run,
    )


def _limit(value: Any, total: float, key: str) -> float:
    if isinstance(value, int):
        return min(value, total)
    if value in (0, 1):
        return total if value else 0
    if total == math.inf:
        raise ConfigError([f"{key}={value} is a fraction of the batches, but the stream does not say its length; "
                           "give a number of batches (or 1.0: all of them)"])
    return int(value * total)


def _whole(batches: float, accumulate: int) -> float:
    """Whole optimizer steps in `batches` micro-batches (math.inf stays math.inf)."""
    return batches if batches == math.inf else batches // accumulate
