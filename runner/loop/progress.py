"""What the loop tells a person while it runs: its start lines, the progress bar or lines, one-line metric summaries.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; rank 0 shows a bar per training
and per validation (tqdm, `trainer.progress_bar`) on a terminal, or, without one, logs a progress line every
PROGRESS_LOG_S seconds.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any, Iterable, Iterator, Union

log = logging.getLogger("runner")

PROGRESS_LOG_S = 10.0  # without a terminal, progress goes to the log this often (log_every_n_steps=1 stays cheap)
PROGRESS_BAR_S = 0.5  # a bar is redrawn at most this often: a step costs a counter increment, nothing more


def _loss(metrics: dict) -> str:
    """The loss in a progress line; none where the steps report none (a LightningModule stepping itself)."""
    return f"loss {metrics['train/loss']:.4f}  " if "train/loss" in metrics else ""


def make_console(schedule: Any, global_batch: int, setting: Union[str, bool], is_global_zero: bool) -> Any:
    """A `Bar` on rank 0 when trainer.progress_bar asks for one (auto: when stderr, where it and the log lines
    go, is a terminal) and tqdm is installed; `Lines` otherwise."""
    wanted = is_global_zero and (setting is True or (setting == "auto" and interactive()))
    tqdm = _tqdm() if wanted else None
    if wanted and tqdm is None and setting is True:
        log.warning("trainer.progress_bar=true needs tqdm, which is not installed (pip install tqdm): progress "
                    "goes to the log as lines instead")
    return Bar(schedule, tqdm) if tqdm is not None else Lines(schedule, global_batch)


class Lines:
    """Progress as log lines: one every PROGRESS_LOG_S seconds at log steps, and at the last step."""

    def __init__(self, schedule: Any, global_batch: int) -> None:
        self.schedule, self.global_batch = schedule, global_batch
        self._last_log = -math.inf

    def step(self, step: int) -> None:
        """A step ended (nothing to show between log steps)."""

    def progress(self, metrics: dict, step: int, epoch: int) -> None:
        """At a log step: a line, when PROGRESS_LOG_S passed since the last one or the run is at its end."""
        total = _total(self.schedule)
        now = time.monotonic()
        if now - self._last_log < PROGRESS_LOG_S and step < total:
            return
        rate = metrics["throughput/samples_per_s"] / self.global_batch
        eta = (total - step) / rate if rate and total < math.inf else float("nan")
        log.info(f"step {step}/{total if total < math.inf else '?'}  epoch {epoch}  {_loss(metrics)}"
                 f"{metrics['throughput/samples_per_s']:.0f} samples/s  eta {eta:.0f}s")
        self._last_log = now

    def batches(self, loader: Iterable, limit: float, what: str) -> Iterable:
        """The batches of a validation, as they come."""
        return loader

    def end(self) -> None:
        """The training ended: the next progress line comes at once."""
        self._last_log = -math.inf


class Bar:
    """tqdm bars on stderr: the training's steps with their rate and ETA, the last log step's loss in its tail,
    and one per validation; log lines to the console print above them while they are open."""

    def __init__(self, schedule: Any, tqdm: Any) -> None:
        self.schedule, self.tqdm = schedule, tqdm
        self.bar: Any = None
        self._redirected: list = []

    def step(self, step: int) -> None:
        """A step ended: count it (tqdm redraws at most every PROGRESS_BAR_S)."""
        if self.bar is None:
            self._open(step - 1)
        self.bar.update()

    def progress(self, metrics: dict, step: int, epoch: int) -> None:
        """At a log step: its loss and throughput in the bar's tail, shown at the next redraw."""
        if self.bar is not None:
            self.bar.set_postfix_str(f"epoch {epoch}, {_loss(metrics).strip()}, "
                                     f"{metrics['throughput/samples_per_s']:.0f} samples/s", refresh=False)

    def batches(self, loader: Iterable, limit: float, what: str) -> Iterator:
        """The batches of a validation, counted on a bar of their own that goes when it ends."""
        total = min(limit, loader_length(loader))
        with self._bar(total=None if total == math.inf else int(total), desc=what, unit="batch",
                       leave=False) as bar:
            for batch in loader:
                yield batch
                bar.update()

    def end(self) -> None:
        """The training ended: the bar stays on screen as it last was; log lines print as before."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for handler, stream in self._redirected:
            handler.setStream(stream)
        self._redirected = []

    def _open(self, initial: int) -> None:
        total = _total(self.schedule)
        self.bar = self._bar(total=None if total == math.inf else int(total), initial=initial, desc="train",
                             unit="step")
        self._redirected = [(handler, handler.setStream(_AboveBars(handler.stream, self.tqdm)))
                            for handler in _console_handlers()]

    def _bar(self, **kwargs: Any) -> Any:
        return self.tqdm(file=sys.stderr, dynamic_ncols=True, mininterval=PROGRESS_BAR_S, **kwargs)


class _AboveBars:
    """A console handler's stream while bars are open: tqdm clears them, the line is written, they come back."""

    def __init__(self, stream: Any, tqdm: Any) -> None:
        self.stream, self.tqdm = stream, tqdm

    def write(self, text: str) -> None:
        self.tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()


def _console_handlers() -> list:
    """The runner's and the root logger's handlers that write to stdout or stderr (not to a file)."""
    handlers = logging.getLogger("runner").handlers + logging.getLogger().handlers
    return [h for h in handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            and h.stream in (sys.stdout, sys.stderr)]


def _tqdm() -> Any:
    """tqdm's bar class, or None where tqdm cannot be imported (a dependency, but an environment may lack it)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _total(schedule: Any) -> float:
    """The step the run ends at (inf when neither trainer.max_steps nor trainer.max_epochs bounds it)."""
    return min(schedule.max_steps, schedule.max_epochs * (schedule.batches_per_epoch // schedule.accumulate))


def loader_length(loader: Any) -> float:
    """The batches `loader` gives (math.inf: an iterable data set that does not say)."""
    try:
        return len(loader)
    except TypeError:
        return math.inf


def announce(loop: Any) -> None:
    """The run's first lines: the global batch and where training starts, or why there is nothing to train."""
    s, p = loop.schedule, loop.progress
    known = s.batches_per_epoch != math.inf
    per_epoch = f"{s.batches_per_epoch // s.accumulate} optimizer steps per epoch" if known else (
        f"a stream of unknown length ({loop.train.identity.get('order', 'the training data')})")
    log.info("global batch %d = data.batch_size %d x %d process(es) x accumulate %d; %s; starting at step %d "
             "(epoch %d, batch %d)", loop.global_batch, loop.train.batch_size, loop.strategy.world_size,
             s.accumulate, per_epoch, p.step, p.epoch, p.batch)
    if s.steps_decide and known:
        log.info("trainer.max_steps=%d decides the length (trainer.max_epochs is not set): %d epoch(s) of "
                 "data", loop.cfg.max_steps, math.ceil(s.max_steps / max(s.batches_per_epoch // s.accumulate, 1)))
    if p.step >= s.max_steps or p.epoch >= s.max_epochs:
        log.warning("nothing to train: the run is already at step %d, epoch %d (trainer.max_steps=%s, "
                    "trainer.max_epochs=%s); raise them to continue", p.step, p.epoch,
                    loop.cfg.max_steps, loop.cfg.max_epochs)


class CompileLines:
    """`trainer.compile`'s two lines, as a callback of the loop: torch.compile compiles during the first step, which
    on a CPU can take minutes with nothing else said; the second line gives the time once that step has ended, and
    the callback then leaves the loop."""

    NAME = "compile_lines"

    def __init__(self, arguments: dict) -> None:
        self.arguments = arguments
        self._start = 0.0

    def on_fit_start(self, loop: Any) -> None:
        settings = ", ".join(f"{k}={v}" for k, v in self.arguments.items()) or "its defaults: the inductor backend"
        log.info("trainer.compile: torch.compile (%s) compiles the model with its loss during the first step, so the "
                 "first steps are slow (minutes for a large model on a CPU); a new input shape (the first "
                 "validation, a shorter last batch) compiles again", settings)
        self._start = time.monotonic()

    def on_train_batch_end(self, loop: Any, outputs: Any, step: int) -> None:
        log.info("trainer.compile: the first step took %.1f s, compilation included; the next ones run the compiled "
                 "code", time.monotonic() - self._start)
        del loop.callbacks.by_name[self.NAME]  # nothing more to say: no call at every step


def too_few_batches(loop: Any) -> str:
    """The error when no optimizer step fits in an epoch."""
    return (f"no full global batch per epoch: the training set gives {loop.train.batches} batch(es) of "
            f"data.batch_size={loop.train.batch_size} per process with {loop.strategy.world_size} process(es), "
            f"fewer than trainer.accumulate_grad_batches={loop.schedule.accumulate} or limited to zero by "
            "trainer.limit_train_batches; use more samples or a smaller batch")


def interactive() -> bool:
    return os.isatty(2) and os.environ.get("TERM") != "dumb"


def fmt(metrics: dict) -> str:
    """One line of the plain values (numbers, strings, flags); nested records (metrics.json's `run`, `best`) are
    left to metrics.json."""
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
                     if not isinstance(v, (dict, list)))
