"""The fixed training loop: it calls the injected strategy, precision, logger and checkpoint objects, nothing else.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the worker builds the
objects, a stage (`runner.stages`) calls `run`, `evaluate` or `predict`. Each step: step → log → validate → save.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from runner.callbacks import Callbacks
from runner.config import ConfigError
from runner.errors import CallbackError, DataError
from runner.flops import StepFlops
from runner.heartbeat import NoHeartbeat
from runner.loop import results, state
from runner.loop.ends import EpochEnd, check_stream_reads, empty_epoch
from runner.loop.even import even_batches
from runner.loop.progress import announce, fmt, loader_length, make_console, too_few_batches
from runner.loop.schedule import Progress, make_schedule
from runner.loop.state import check_loadable
from runner.loop.step import TrainStep
from runner.loop.stop import BatchVote, ReadCut, StopVote
from runner.loop.train_log import TrainLog
from runner.metrics import MetricSet

log = logging.getLogger("runner")


class Loop:
    """Trains `task` (wrapped by the strategy) until max_steps or max_epochs, validating and checkpointing."""

    heartbeat: Any = NoHeartbeat()  # a launched worker's beats (runner.heartbeat.attach)

    def __init__(self, strategy: Any, task: Any, wrapped: Any, optimizer: Any, scheduler: Any, train: Any,
                 val: Any, logger: Any, trainer_cfg: Any, run_dir: Path, stop_requested: Callable[[], int],
                 hparams: dict, metrics: Optional[MetricSet] = None, callbacks: Optional[Callbacks] = None,
                 run_info: Optional[dict] = None, make_scheduler: Optional[Callable[[int], Any]] = None) -> None:
        self.strategy, self.task, self.wrapped = strategy, task, wrapped  # task: the TaskModule strategies wrap
        self.precision = strategy.precision
        self.optimizer, self.scheduler, self.train, self.val, self.logger = optimizer, scheduler, train, val, logger
        self.cfg, self.run_dir, self.hparams = trainer_cfg, run_dir, hparams
        self.run_info = run_info  # what ran where (runner.stages.run_info): `run` in every stage's metrics.json
        self.make_scheduler = make_scheduler  # the configured scheduler over N steps (a resume's new schedule)
        self.schedule = s = make_schedule(trainer_cfg, train.batches, loader_length(val) if val is not None else 0)
        self.progress = Progress()
        self.global_batch = train.batch_size * strategy.world_size * s.accumulate
        self.metrics = metrics or MetricSet({}, strategy)
        self.callbacks = callbacks or Callbacks()
        self.stop_vote = StopVote(strategy, stop_requested, on_stop=self.request_stop)
        self._signalled = 0  # the signal some process got: stop now, skip the final validation
        self._stop_reason: Optional[str] = None  # a callback asked to end the run (early stopping)
        self.train_step = TrainStep(strategy, task, wrapped, optimizer, scheduler, self.metrics, train.batch_size,
                                    s.accumulate, trainer_cfg)
        self.train_log = TrainLog(self)
        self.console = make_console(s, self.global_batch, trainer_cfg.get("progress_bar", "auto"),
                                    strategy.is_global_zero)
        self.last_val_step = -1
        # The step whose validation a stop signal put off: the checkpoint says so, and the resumed run validates first.
        self.validation_due = -1
        self.periodic: Optional[list[Path]] = None  # the step-N checkpoints on disk or being written
        self.flops = StepFlops(strategy, task, wrapped, train.batch_size, trainer_cfg.get("peak_tflops"))
        self.epoch_end = EpochEnd(strategy, s, train.what)
        # A stop signal that comes while the data keeps this process waiting (a stream that blocks) ends the wait.
        self.reading = getattr(stop_requested, "reading", contextlib.nullcontext)

    def run(self) -> dict:
        try:
            return self._run()
        except BaseException as error:
            self.console.end()
            self.callbacks.call("on_exception", self, error)
            raise

    def _run(self) -> dict:
        s, p = self.schedule, self.progress
        if s.batches_per_epoch < 1:
            raise ConfigError([too_few_batches(self)])
        announce(self)
        check_loadable(self, {"data_state": self.train.state_dict()})  # a stream's own state, before any step
        self.callbacks.call("on_fit_start", self)
        self.train_log.begin()
        if self.validation_due == self.progress.step:  # the stopped run's due validation, before any step
            self._validate()
        stopped = False
        while p.step < s.max_steps and p.epoch < s.max_epochs and not stopped:
            self.task.train()
            batches, fresh, ended = self.train.epoch(p.epoch, p.batch), p.batch == 0, False
            while p.batch < s.batches_per_epoch and not stopped and p.step < s.max_steps:
                self.heartbeat.step(p.step)  # the launcher's stall watch sees this process advance
                try:
                    with self.reading():  # a stop signal while the data keeps this process waiting is not lost
                        window = self.epoch_end.window(batches, p.epoch, p.batch)  # one step's micro-batches
                except ReadCut as cut:
                    return self._read_cut(cut.signum)
                if window is None:  # a stream of unknown length ended, on every process
                    if fresh and p.batch == 0:
                        self._empty_epoch()
                    ended = True
                    break
                p.batch += s.accumulate
                if self.flops.pending:  # the first step, its FLOPs counted: on the meta device, else on the step
                    self.train_log.tick += self.flops.count(window, lambda: self.train_step(window, self))
                else:
                    self.train_step(window, self)  # the loop: its callbacks get on_before_optimizer_step
                p.step += 1
                self.callbacks.call("on_train_batch_end", self, self.train_step.outputs, p.step)
                stopped = self._after_step()
            if ended or p.batch >= s.batches_per_epoch:  # the epoch's data is done
                p.epoch, p.batch = p.epoch + 1, 0
                if s.val_each_epoch and not stopped:  # a stream of unknown length: its epoch ends when it does
                    self._validate()  # a signal or a callback may end the run here
                    stopped = bool(self._signalled) or self._stop_reason is not None
                elif s.val_each_epoch and self._signalled:
                    self.validation_due = p.step
        return self._finish()

    def _read_cut(self, signum: int) -> dict:
        """A stop signal came while this process waited for its training data, which did not come in time: one
        process stops where it stands, saved (its data replays to this step on resume); one of several ends its
        job without a checkpoint of this step (the others wait on it in their collectives)."""
        name, p = signal.Signals(signum).name, self.progress
        if self.strategy.world_size > 1:
            last = self.run_dir / "checkpoints" / "last.ckpt"
            kept = f"the last checkpoint is {last}" if last.exists() else "no checkpoint was saved yet"
            raise DataError(f"stopped by {name} while rank {self.strategy.global_rank} waited for its training data "
                            f"after step {p.step} ({self.epoch_end.what} gave nothing in time); {kept}")
        log.warning("%s came while the training data kept this process waiting after step %d: the read is cut, "
                    "and last.ckpt keeps the data's position alone (a resume replays the data to it)", name, p.step)
        self.train.forget_state()
        self._signalled = signum
        return self._finish()

    def _empty_epoch(self) -> None:
        """An epoch with no optimizer step in it ends the run (it would only be followed by more such epochs):
        saved at the start of that epoch, then one line."""
        p = self.progress
        p.epoch, p.batch = p.epoch + 1, 0
        saved = "nothing was saved (trainer.fast_dev_run)" if p.step else "nothing was trained"
        if self.schedule.save and p.step:
            self.train_log.collect()  # the last log step's line comes before the checkpoint
            state.save(self, periodic=False)
            saved = f"last.ckpt is saved at step {p.step} ({self.run_dir / 'checkpoints' / 'last.ckpt'})"
        raise empty_epoch(self.epoch_end.what, p.epoch - 1, p.step, saved)

    def _after_step(self) -> bool:
        """Log, validate and checkpoint when due. Returns True when the run must stop (a signal or a callback)."""
        s, step, train_log = self.schedule, self.progress.step, self.train_log
        self.console.step(step)
        self._signalled = self.stop_vote()
        train_log.collect()  # the last log step's sums, reduced while this step trained
        periodic = step % s.ckpt_every == 0
        if step % s.log_every == 0:  # the window is trainer.log_every_n_steps; a checkpoint carries it on
            train_log.start()
        elif self._signalled:  # the end of the run: its last window is logged, and left open for a resume
            train_log.start(close=False)
        validate = step % s.val_every == 0 and not self._signalled
        if step % s.val_every == 0 and self._signalled:
            self.validation_due = step
        if validate or periodic or self._signalled:
            train_log.collect()  # a step's train line comes before its val line and its checkpoint
        if validate:
            self._validate()  # callbacks may ask to stop here
        stop = self._signalled or self._stop_reason is not None
        if s.save and (periodic or stop):
            state.save(self, periodic=periodic)
        return stop

    def _finish(self) -> dict:
        self._signalled = self._signalled or self.stop_vote.final()
        self.train_log.finish()
        if not self._signalled:  # a signal stops at once; early stopping has validated this step already
            self._validate()
        if self.schedule.save:
            state.save(self, periodic=False)
        result = self._with_run_info(results.fit_result(self, self._signalled, self._stop_reason))
        self.callbacks.call("on_fit_end", self, result)
        self.strategy.checkpoint_io.wait()  # metrics.json never names a step whose checkpoint is not on disk
        if self.strategy.is_global_zero:
            results.publish(self, result)
        self.strategy.barrier("finish")
        return result

    def request_stop(self, reason: str) -> None:
        """End the run after this step's checkpoint (every process must ask at the same step)."""
        self._stop_reason = reason

    def _validate(self) -> None:
        if self.val is None or self.last_val_step == self.progress.step:
            return
        start = time.perf_counter()
        metrics = self.evaluate("val", self.val, self.schedule.val_batches)
        signalled = metrics.pop("stop_signal", 0)  # stopped partway: nothing for callbacks to rank or stop on
        if signalled:  # cut short: the checkpoint says it is due, and a resumed run runs it first
            self.validation_due = self.progress.step
        else:
            self.last_val_step = self.progress.step
        self._signalled = self._signalled or signalled
        if metrics and not signalled:
            try:
                self.callbacks.call("on_validation_end", self, {**self.progress.metrics, **metrics}, self.progress.step)
            except (CallbackError, ConfigError) as refused:  # a setting only a validation can check: keep what trained
                raise state.saved_before(self, refused) from None
        self.train_log.tick += time.perf_counter() - start  # validation time is not training throughput

    def evaluate(self, prefix: str, loader: Any, limit: float = math.inf) -> dict:
        """The task's metrics and the `metrics` config's over `loader` (every sample once over the processes),
        logged as `<prefix>/<name>` at the current step; every process calls it."""
        start, task, preds = time.perf_counter(), self.task.task, self.metrics.wants("val")
        self.task.eval()
        names = task.stat_names
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.strategy.root_device)
        validating = prefix == "val"  # the validation hooks: not for a test
        if validating:
            self.callbacks.call("on_validation_start", self)
        batch_end = self.callbacks.methods("on_validation_batch_end") if validating else ()
        length = loader_length(loader)  # math.inf: a stream that does not say (then a limit bounds the pass)
        count = min(limit, length)
        # Only a length every process knows is a count they vote over; a limited stream may end before the limit.
        vote = BatchVote(self.strategy, self.stop_vote.requested, count if length < math.inf else math.inf)
        signalled, done = 0, 0
        with torch.no_grad():
            batches = even_batches(self.strategy, self.console.batches(loader, limit, prefix), count)
            for index, (batch, real) in enumerate(batches):  # `count` batches, then any padding
                signalled = vote(index)  # every process stops at the same batch
                if signalled:
                    break
                task.discard = not real  # a padding forward for the other processes' collectives: it counts for nothing
                out = self.strategy.validation_step(self.wrapped, self.strategy.batch_to_device(batch), preds)
                task.discard = False
                if not real:
                    continue
                sums += out["stats"].sum(dim=0)
                self.metrics.update("val", out)
                for hook in batch_end:
                    hook(self, out, index)
                done += 1
        self.task.train()
        if validating:
            self.callbacks.call("on_validation_epoch_end", self)
        if length == math.inf:  # the processes read one stream: as far, each
            check_stream_reads(self.strategy, loader, prefix)
        totals = dict(zip(names, self.strategy.all_reduce(sums, reduce_op="sum").tolist()))
        extra = self.metrics.compute("val", prefix)  # every process, even one without a sample
        signalled = signalled or vote.final()
        if signalled:  # a partial pass's numbers are no metrics: the stage reports the stop instead
            log.warning("%s stopped by %s after %d of its batches", prefix, signal.Signals(signalled).name, done)
            return {"stop_signal": signalled}
        if not totals["samples"]:
            return {}
        metrics = {**{f"{prefix}/{name}": value for name, value in task.compute(totals).items()}, **extra}
        self.progress.metrics.update(metrics)
        self.logger.log_metrics(metrics, self.progress.step)
        log.info("step %d  %s  (%d samples, %.2fs)", self.progress.step, fmt(metrics), totals["samples"],
                 time.perf_counter() - start)
        return metrics

    def predict(self, loader: Any) -> list:
        """The model's predictions for every sample of `loader`, in the data set's order (on rank 0; [] elsewhere).

        Rank r of W predicts samples r, r+W, ...; rank 0 gathers every rank's share and interleaves them.
        """
        mine: list[torch.Tensor] = []
        self.task.eval()
        module, task = self.strategy.unwrap(self.wrapped), self.task.task
        with torch.no_grad():
            for batch, real in even_batches(self.strategy, loader, loader_length(loader)):  # FSDP: even forwards
                task.discard = not real
                predicted = module.predict(self.strategy.batch_to_device(batch))
                task.discard = False
                mine += [p.cpu() for p in predicted.unbind(0)] if real else []
        self.task.train()
        shares = [self.strategy.broadcast(mine if rank == self.strategy.global_rank else None, src=rank)
                  for rank in range(self.strategy.world_size)]
        if not self.strategy.is_global_zero:
            return []
        world = len(shares)
        return [shares[index % world][index // world] for index in range(sum(len(share) for share in shares))]

    # What the worker, the stages and callbacks call: runner.loop.state and runner.loop.results do the work.
    def state_dict(self) -> dict:
        return state.state_dict(self)

    def load_state_dict(self, checkpoint: dict) -> None:
        state.load_state_dict(self, checkpoint)

    def load_weights(self, checkpoint: dict) -> None:
        state.load_weights(self, checkpoint)

    def write_result(self, result: dict) -> None:
        results.write_result(self.run_dir, self._with_run_info(result), self.strategy.is_global_zero)

    def _with_run_info(self, result: dict) -> dict:
        if self.run_info is not None:
            result["run"] = dict(self.run_info)
        return result

    def save_checkpoint(self, path: Path, state: Optional[dict] = None) -> None:
        """Write the run's state to `path` (rank 0, through the checkpoint IO); every process calls it."""
        state = self.state_dict() if state is None else state
        self.callbacks.call("on_save_checkpoint", self, state)
        check_loadable(self, state)
        self.strategy.save_checkpoint(state, path)
        self.callbacks.call("on_checkpoint_saved", self, path)

    def remove_checkpoint(self, path: Path) -> None:
        """Remove one of this run's checkpoint files (rank 0, after the checkpoint IO's pending writes)."""
        self.strategy.remove_checkpoint(path)
