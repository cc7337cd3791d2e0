"""What the loop tells a person while it runs: its start lines, the progress line, one-line metric summaries.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; rank 0 prints, to a terminal
(one line rewritten at each log step) or, without one, to the log every PROGRESS_LOG_S seconds.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

log = logging.getLogger("runner")

PROGRESS_LOG_S = 10.0  # without a terminal, progress goes to the log this often (log_every_n_steps=1 stays cheap)


class Console:
    """The progress line of a run with `schedule` and `global_batch` samples per step; `show`: a terminal's."""

    def __init__(self, schedule: Any, global_batch: int, show: bool) -> None:
        self.schedule, self.global_batch, self.show = schedule, global_batch, show
        self._open = False
        self._last_log = -math.inf

    def progress(self, metrics: dict, step: int, epoch: int) -> None:
        """A terminal gets one line rewritten at every log step; a log file one line every PROGRESS_LOG_S."""
        s = self.schedule
        total = min(s.max_steps, s.max_epochs * (s.batches_per_epoch // s.accumulate))
        now = time.monotonic()
        if not self.show and now - self._last_log < PROGRESS_LOG_S and step < total:
            return
        rate = metrics["throughput/samples_per_s"] / self.global_batch
        eta = (total - step) / rate if rate and total < math.inf else float("nan")
        line = (f"step {step}/{total if total < math.inf else '?'}  epoch {epoch}  "
                f"loss {metrics['train/loss']:.4f}  {metrics['throughput/samples_per_s']:.0f} samples/s  "
                f"eta {eta:.0f}s")
        if not self.show:
            log.info(line)
            self._last_log = now
            return
        sys.stderr.write(f"\r{line}\033[K")  # rewrite the same terminal line; \033[K clears its tail
        sys.stderr.flush()
        self._open = True

    def end(self) -> None:
        """Move past the progress line before anything else is printed."""
        if self._open:
            sys.stderr.write("\n")
            self._open = False
        self._last_log = -math.inf


def announce(loop: Any) -> None:
    """The run's first lines: the global batch and where training starts, or why there is nothing to train."""
    s, p = loop.schedule, loop.progress
    log.info("global batch %d = data.batch_size %d x %d process(es) x accumulate %d; %d optimizer steps "
             "per epoch; starting at step %d (epoch %d, batch %d)", loop.global_batch, loop.train.batch_size,
             loop.strategy.world_size, s.accumulate, s.batches_per_epoch // s.accumulate, p.step, p.epoch,
             p.batch)
    if s.steps_decide:
        log.info("trainer.max_steps=%d decides the length (trainer.max_epochs is not set): %d epoch(s) of "
                 "data", loop.cfg.max_steps, math.ceil(s.max_steps / max(s.batches_per_epoch // s.accumulate, 1)))
    if p.step >= s.max_steps or p.epoch >= s.max_epochs:
        log.warning("nothing to train: the run is already at step %d, epoch %d (trainer.max_steps=%s, "
                    "trainer.max_epochs=%s); raise them to continue", p.step, p.epoch,
                    loop.cfg.max_steps, loop.cfg.max_epochs)


def too_few_batches(loop: Any) -> str:
    """The error when no optimizer step fits in an epoch."""
    return (f"no full global batch per epoch: the training set gives {len(loop.train)} batch(es) of "
            f"data.batch_size={loop.train.batch_size} per process with {loop.strategy.world_size} process(es), "
            f"fewer than trainer.accumulate_grad_batches={loop.schedule.accumulate} or limited to zero by "
            "trainer.limit_train_batches; use more samples or a smaller batch")


def interactive() -> bool:
    return os.isatty(2) and os.environ.get("TERM") != "dumb"


def fmt(metrics: dict) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
