"""Lightning's hooks at the runner's callback points: one runner callback that calls the LightningModule's hooks and
the Lightning callbacks' `(trainer, pl_module, ...)` hooks, in Lightning's order (callbacks, then the module).

The runner's loop has no epoch hooks; Lightning's are kept honestly from its position: on_train_epoch_start before
the epoch's first training batch (in the step), on_train_epoch_end once the epoch's last step is taken, after the
validation that closes it when one does (as Lightning orders them), before that step's checkpoint. Epoch-interval
schedulers step there, so a checkpoint holds their state and a resume continues exactly.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from runner.lightning.detect import is_lightning_module, overrides
from runner.lightning.optimizers import LightningSchedules
from runner.lightning.record import Evaluation, LogRecorder
from runner.tasks.base import BatchError


class LightningHooks:
    """The runner callback (`loop.callbacks.by_name["lightning"]`) that speaks Lightning for `module` (the user's
    model: a LightningModule, or a plain module given to Lightning callbacks) and `callbacks` (name -> a Lightning
    Callback); `view` is every hook's `trainer`."""

    def __init__(self, view: Any, loop: Any, module: Any, callbacks: dict[str, Any]) -> None:
        from runner.lightning.task import LightningTask

        self.view, self.loop, self.strategy = view, loop, loop.strategy
        self.module, self.callbacks = module, callbacks
        self.lightning = is_lightning_module(module)
        self.task = loop.task.task if isinstance(loop.task.task, LightningTask) else None
        self.recorder = LogRecorder()
        self._table: dict[str, list[Callable]] = {}
        self._step, self._micro = -1, 0  # the step whose micro-batches are being counted
        self.started: Optional[int] = None  # the epoch whose on_train_epoch_start ran
        self.ended: Optional[int] = None  # the last epoch whose on_train_epoch_end ran
        self.keeps_step_outputs = self.has("on_train_batch_end")
        # `trainer.should_stop` set on some process stops every process: the loop's stop vote carries it.
        loop.stop_vote.watch(lambda: view.should_stop,
                             "trainer.should_stop was set (by the LightningModule or a Lightning callback)")

    # -- calling hooks ---------------------------------------------------------------------------------------------
    def _methods(self, hook: str) -> list[Callable]:
        found = self._table.get(hook)
        if found is None:
            found = [_named(f"callbacks.{name}.{hook}()", functools.partial(getattr(cb, hook), self.view, self.module))
                     for name, cb in self.callbacks.items() if overrides(cb, hook)]
            if self.lightning and overrides(self.module, hook):
                found.append(_named(f"model ({type(self.module).__name__}).{hook}()", getattr(self.module, hook)))
            self._table[hook] = found
        return found

    def has(self, hook: str) -> bool:
        return bool(self._methods(hook))

    def call(self, hook: str, *args: Any, where: Optional[str] = None) -> dict:
        """Call `hook` on the Lightning callbacks, then the module. Its `self.log` values are taken as `where`'s (a
        split), or, inside a step, as the step's; elsewhere a `self.log` is refused naming the hook."""
        methods = self._methods(hook)
        if not methods:
            return {}
        if where is None and self.recorder.where is not None:
            for method in methods:
                _checked(hook, method(*args))
            return {}
        with self.recorder.recording(where, hook) as logged:
            for method in methods:
                _checked(hook, method(*args))
        return logged

    # -- training --------------------------------------------------------------------------------------------------
    def on_fit_start(self, loop: Any) -> None:
        if isinstance(loop.scheduler, LightningSchedules):
            loop.scheduler.metrics = lambda: loop.progress.metrics
            loop.scheduler.module = self.module if self.lightning else None
        self.call("on_fit_start")
        self.call("on_train_start")

    def train_batch_index(self) -> int:
        """Lightning's batch_idx of the micro-batch being trained: its index in the epoch on this process."""
        p = self.loop.progress
        if p.step != self._step:  # the step's first micro-batch (the loop counted the step's batches already)
            self._step, self._micro = p.step, 0
            if self.task is not None:
                self.task.step_records = []
        index = p.batch - self.loop.schedule.accumulate + self._micro
        self._micro += 1
        return index

    def before_train_batch(self, batch: Any, batch_idx: int) -> None:
        epoch = self.loop.progress.epoch
        if self.started != epoch:
            if self.started is not None:  # an end no step or validation saw (a stream's epoch without one)
                self._end_epoch(self.started)
            self.started = epoch
            self.call("on_train_epoch_start")
        self.call("on_train_batch_start", batch, batch_idx)

    def on_before_optimizer_step(self, loop: Any, optimizer: Any) -> None:
        self.call("on_before_optimizer_step", optimizer)

    def on_train_batch_end(self, loop: Any, outputs: list, step: int) -> None:
        for output, batch, batch_idx in self.task.step_records if self.task is not None else ():
            self.call("on_train_batch_end", output, batch, batch_idx)
        if self.task is not None:
            self.task.step_records = []
        p, s = loop.progress, loop.schedule
        if p.batch >= s.batches_per_epoch and not _validates_now(loop):
            self._end_epoch(p.epoch)

    def _end_epoch(self, epoch: Optional[int], scheduler: bool = True) -> None:
        if epoch is None or epoch == self.ended or self.view._stage != "fit":
            return
        self.ended = epoch
        self.call("on_train_epoch_end")
        if self.task is not None:
            self.task.reset_train_metrics()  # Lightning resets the Metric objects logged in training each epoch
        if scheduler and isinstance(self.loop.scheduler, LightningSchedules):
            self.loop.scheduler.epoch_end()

    def no_loss(self, model: torch.nn.Module) -> torch.Tensor:
        """The loss of a skipped micro-batch: nothing to back-propagate; under DDP a zero that reaches every
        parameter, so that every process's backward pass syncs the same buckets."""
        zero = torch.zeros((), device=self.strategy.root_device)
        if self.strategy.world_size == 1:
            return zero.requires_grad_()
        return sum((p.sum() * 0.0 for p in model.parameters() if p.requires_grad), zero)

    # -- evaluation -------------------------------------------------------------------------------------------------
    def on_validation_start(self, loop: Any) -> None:
        self.view.evaluating("val")
        evaluation = self.task.open("val") if self.task is not None else None
        for hook in ("on_validation_start", "on_validation_epoch_start"):
            self._add(evaluation, self.call(hook, where="val"))

    def on_validation_epoch_end(self, loop: Any) -> None:
        evaluation = self.task.evaluations.get("val") if self.task is not None else None
        self._add(evaluation, self.call("on_validation_epoch_end", where="val"))
        if self.task is not None:
            self.task.split = "test"  # batches after this validation are a test's, unless another one starts

    def on_validation_end(self, loop: Any, metrics: dict, step: int) -> None:
        self.call("on_validation_end")
        self.view.evaluating(None)
        p, s = loop.progress, loop.schedule
        closing = p.epoch if p.batch >= s.batches_per_epoch else p.epoch - 1 if p.batch == 0 and p.epoch else None
        if closing is not None and (self.task is None or closing == self.started):  # the validation closing it
            self._end_epoch(closing)
        if self.view._stage == "fit":  # set at a validation (EarlyStopping): every process stops after it
            loop.stop_vote.flags_now()

    def test_start(self) -> None:
        self.view.evaluating("test")
        evaluation = self.task.evaluations.get("test")
        for hook in ("on_test_start", "on_test_epoch_start"):
            self._add(evaluation, self.call(hook, where="test"))

    def test_epoch_end(self, evaluation: Evaluation) -> None:
        self._add(evaluation, self.call("on_test_epoch_end", where="test"))

    def test_end(self) -> None:
        self.call("on_test_end")
        self.view.evaluating(None)

    def _add(self, evaluation: Optional[Evaluation], logged: dict) -> None:
        """Values logged in an epoch hook: one value per process (weight 1), averaged over the processes."""
        if logged and evaluation is not None:
            evaluation.add(logged, None, self.module)

    # -- the run's ends and checkpoints ------------------------------------------------------------------------------
    def on_fit_end(self, loop: Any, result: dict) -> None:
        if self.started is not None and self.ended != self.started:  # a run that stops mid-epoch ends its epoch
            self._end_epoch(self.started, scheduler=False)  # (its last checkpoint is written already)
        self.call("on_train_end")
        self.call("on_fit_end")
        for method in self._methods("teardown"):
            method("fit")

    def on_exception(self, loop: Any, error: BaseException) -> None:
        for callback in self.callbacks.values():
            if overrides(callback, "on_exception"):
                callback.on_exception(self.view, self.module, error)

    def setup_callbacks(self, stage: str) -> None:
        for callback in self.callbacks.values():
            if overrides(callback, "setup"):
                callback.setup(self.view, self.module, stage)

    def state_dict(self) -> dict:
        """What the module's on_save_checkpoint adds, and each Lightning callback's state_dict() and additions."""
        state: dict = {"callbacks": {}}
        if self.lightning and overrides(self.module, "on_save_checkpoint"):
            state["module"] = {}
            self.module.on_save_checkpoint(state["module"])
        for name, callback in self.callbacks.items():
            entry = state["callbacks"][name] = {"state": callback.state_dict()}
            if overrides(callback, "on_save_checkpoint"):
                entry["checkpoint"] = {}
                callback.on_save_checkpoint(self.view, self.module, entry["checkpoint"])
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.lightning and overrides(self.module, "on_load_checkpoint"):
            self.module.on_load_checkpoint(state.get("module", {}))
        for name, callback in self.callbacks.items():
            entry = state.get("callbacks", {}).get(name)
            if entry is None:
                continue
            callback.load_state_dict(entry.get("state", {}))
            if overrides(callback, "on_load_checkpoint"):
                callback.on_load_checkpoint(self.view, self.module, entry.get("checkpoint", {}))


def _validates_now(loop: Any) -> bool:
    """Whether the step just taken validates (the loop's own rule), so that the epoch ends after that validation."""
    s = loop.schedule
    return loop.val is not None and bool(s.val_batches) and loop.progress.step % s.val_every == 0


def _named(label: str, method: Callable) -> Callable:
    """A Lightning hook whose raise (or sys.exit) is one line naming it, its traceback in the log files; the runner's
    own errors (a refused self.log), a stop and a lost process pass as they are."""
    from runner.errors import HookFailed, is_user_error
    from runner.processes import peer_gone

    def call(*args: Any) -> Any:
        try:
            return method(*args)
        except (Exception, SystemExit) as error:  # noqa: BLE001 - any failure of the user's hook is that hook's
            if isinstance(error, Exception) and (is_user_error(error) or peer_gone(error)):
                raise
            raise HookFailed(label, error) from error
    return call


def _checked(hook: str, returned: Any) -> None:
    if hook == "on_train_batch_start" and isinstance(returned, int) and returned == -1:
        raise BatchError("on_train_batch_start returned -1 (skip the rest of the epoch): the runner's epochs have a "
                         "fixed number of steps on every process; set trainer.limit_train_batches instead")
