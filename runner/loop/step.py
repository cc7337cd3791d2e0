"""One optimizer step: the micro-batches of an accumulation window forward and backward, weighted so the step
follows the mean over the global batch, clipped, guarded against non-finite values, then the optimizer and
scheduler steps.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the loop calls the step
once per optimizer step and reads its summed statistics at log steps (`runner.loop.train_log`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from runner.errors import NonFiniteLossError  # noqa: F401 - defined there: is_user_error knows it without the loop
from runner.loop.optimizers import average_gradients, optimizers_of
from runner.tasks.base import BatchError, StepWeights


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


class TrainStep:
    """Calling it with the micro-batches of one optimizer step trains on them; the task's statistics add up in
    `sums` (on the device, no host sync) until the log step that reduces them."""

    def __init__(self, strategy: Any, task: Any, wrapped: Any, optimizer: Any, scheduler: Any, metrics: Any,
                 batch_size: int, accumulate: int, trainer_cfg: Any) -> None:
        self.strategy, self.task, self.wrapped = strategy, task, wrapped  # task: the TaskModule strategies wrap
        self.precision = strategy.precision
        self.optimizer, self.scheduler, self.metrics = optimizer, scheduler, metrics
        self.weights = StepWeights(task.task, strategy, batch_size, accumulate)
        self.clip = trainer_cfg.gradient_clip_val  # read once: a DictConfig look-up per step costs
        self.guard = NonFiniteGuard(strategy, bool(trainer_cfg.get("skip_nonfinite_loss", False)),
                                    gradients=not self.precision.skips_nonfinite_steps)
        self.sums: Optional[torch.Tensor] = None  # the task's statistics since the last log step
        self.names: tuple[str, ...] = ()
        # The total 2-norm of the last clipped step's gradients before clipping (a device tensor: no host sync).
        self.grad_norm: Optional[torch.Tensor] = None
        self.outputs: list = []  # the last step's micro-batch outputs, kept only for on_train_batch_end
        self.lrs: Optional[list] = None  # each param group's learning rate in the last step (before the scheduler's)
        self.taken = self.empty_steps = 0  # steps called; those whose every micro-batch was skipped (no optimizer step)
        # A task with one loss per named optimizer: [(name, its parameters)], each loss back-propagated into its own.
        self.parts = loss_parts(task.task, optimizer)

    def __call__(self, window: list, loop: Any = None) -> None:
        """Forward and backward each micro-batch of one optimizer step (gradients synced on the last), then step.

        Each micro-batch's loss is a sum over its units; `weights` scales it so that the step follows the
        mean over every unit of the global batch, whatever its split over processes and micro-batches.
        `loop`'s callbacks get on_before_optimizer_step, and on_train_batch_end reads `outputs`.
        """
        self.lrs = [group["lr"] for group in self.optimizer.param_groups]  # what this step trains with (logged)
        scale, stats, counts, last = self.weights.start(window), [], [], len(window) - 1
        self.taken += 1
        hooks = loop.callbacks if loop is not None else None
        keep = hooks is not None and hooks.has("on_train_batch_end")
        self.outputs = []
        for index, batch in enumerate(window):
            # Per-optimizer losses back-propagate more than once per forward: gradients are averaged after the window.
            with self.strategy.backward_sync(self.wrapped, enabled=index == last and self.parts is None):
                out = self.strategy.training_step(self.wrapped, self.strategy.batch_to_device(batch),
                                                  self.metrics.wants("train"))
                loss = self.task.batch_loss(out)
                if self.parts is None and isinstance(loss, dict):
                    raise BatchError(f"task ({type(self.task.task).__name__}) returned one loss per name "
                                     f"({', '.join(map(str, loss))}): set losses_per_optimizer = True on the task "
                                     "class and name the optimizers in the config (optimizer.<name>._params_)")
                loss = self._backward(loss, scale())
            if not self.guard.check(loss):
                self.accumulate(out)
                self.metrics.update("train", out)
            stats.append(out["stats"])
            counts.append(out.get("unit_count"))
            if keep:
                self.outputs.append(out)
        skip = self.guard.skip_step()
        units = None if skip else self.weights.units(stats, counts)
        if units == 0:  # every micro-batch skipped on every process (its step returned None): no optimizer step
            self.empty_steps += 1
        elif not skip:
            if self.parts is not None:
                for optimizer in optimizers_of(self.optimizer):
                    average_gradients(self.strategy, optimizer)
            self.precision.unscale_gradients(self.optimizer)
            self.weights.finish(self.task.parameters(), units)
            if hooks is not None:
                hooks.call("on_before_optimizer_step", loop, self.optimizer)
            if self.clip is not None:
                self.grad_norm = torch.nn.utils.clip_grad_norm_(self.task.parameters(), self.clip)
            if not self.guard.skip_gradients(self.task.parameters()):
                self.precision.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _backward(self, loss: Any, scale: Any) -> torch.Tensor:
        """Back-propagate the micro-batch's loss; per-optimizer losses each into their optimizer's parameters only.
        Returns the total loss (what the guard checks)."""
        if self.parts is None:
            self.precision.backward(loss * scale)
            return loss
        names = [name for name, _ in self.parts]
        if not isinstance(loss, dict) or set(loss) != set(names):
            got = ", ".join(map(str, loss)) if isinstance(loss, dict) else "one loss"
            raise BatchError(f"task ({type(self.task.task).__name__}) sets losses_per_optimizer: its loss must be a "
                             f"dict with one entry per optimizer ({', '.join(names)}); it gave {got}")
        for index, (name, parameters) in enumerate(self.parts):
            self.precision.backward(loss[name] * scale, inputs=parameters, retain_graph=index < len(names) - 1)
        return sum(loss.values())

    def buffer(self) -> torch.Tensor:
        """The task's statistics summed since the last log step (made at the first use, once the task knows
        its columns)."""
        if self.sums is None:
            self.names = self.task.task.stat_names
            self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.strategy.root_device)
        return self.sums

    def accumulate(self, out: dict) -> None:
        """Add a micro-batch's sums on the device: no host sync until the next log step."""
        self.buffer().add_(out["stats"].sum(dim=0))


def loss_parts(task: Any, optimizer: Any) -> Optional[list]:
    """[(optimizer name, its trainable parameters)] for a task with `losses_per_optimizer` over named optimizers."""
    from runner.loop.optimizers import OptimizerSet

    if not getattr(task, "losses_per_optimizer", False):
        return None
    if not isinstance(optimizer, OptimizerSet):
        raise BatchError(f"task ({type(task).__name__}) gives one loss per optimizer (losses_per_optimizer): name the "
                         "optimizers in the config, each over its part (optimizer.<name>._params_)")
    return [(name, [p for group in part.param_groups for p in group["params"] if p.requires_grad])
            for name, part in zip(optimizer.names, optimizer.optimizers)]
