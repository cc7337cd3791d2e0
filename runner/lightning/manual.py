"""Lightning's manual optimization (`self.automatic_optimization = False`): the module's training_step calls
`self.manual_backward(loss)` and steps the optimizers `self.optimizers()` gives, one or several (a GAN's generator
and discriminator), and its schedulers itself.

Under DDP gradients are averaged over processes at each optimizer's step, for that optimizer's parameters only: a
step may run several backward passes through parts of one forward graph, which DDP's own gradient hooks (one
reduction per parameter per forward) do not allow, so the runner's step runs the module's forward without them.
Under FSDP each backward pass reduce-scatters (averages) the gradients of the units it went through, as FSDP does,
and the shards' gradients add up over the step's backward passes. With equal shares of a global batch per process
this is the gradient one process computes on the whole batch. A loss scaler (16-mixed) scales each backward pass,
unscales at each step, and updates once per training step.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from runner.loop.optimizers import average_gradients, optimizers_of
from runner.loop.step import TrainStep


def is_manual(module: Any) -> bool:
    return not getattr(module, "automatic_optimization", True)


class ManualOptimizer:
    """What `self.optimizers()` gives under manual optimization: the torch optimizer, whose `step()` first averages
    its gradients over processes, then calls on_before_optimizer_step, then steps through the precision."""

    def __init__(self, optimizer: torch.optim.Optimizer, loop: Any, module: Any, reduced: bool = False) -> None:
        self.optimizer, self._loop, self._module = optimizer, loop, module
        # gradients averaged since the last step (clip_gradients then step() average once); `reduced`: by the
        # strategy at each backward pass (FSDP's reduce-scatter), never here
        self._synced = self._reduced = reduced

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._synced = self._reduced

    def sync(self) -> None:
        """Average this optimizer's gradients over the processes (once until its next step)."""
        if not self._synced:
            average_gradients(self._loop.strategy, self.optimizer)
            self._synced = True

    def step(self, closure: Optional[Any] = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None  # Lightning's closure: the loss and its backward pass
        loop = self._loop
        self.sync()
        loop.callbacks.call("on_before_optimizer_step", loop, self.optimizer)
        loop.precision.optimizer_step(self.optimizer, update=False)
        self._synced = self._reduced
        return result

    @contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        """Lightning's `with opt.toggle_model():` only this optimizer's parameters take gradients inside."""
        self._module.toggle_optimizer(self)
        try:
            yield
        finally:
            self._module.untoggle_optimizer(self)

    def __repr__(self) -> str:
        return f"ManualOptimizer({type(self.optimizer).__name__})"


class ManualStep(TrainStep):
    """The runner's step for a module under manual optimization: its training_step (through the strategy's wrapper,
    without DDP's gradient hooks; with FSDP's, which reduce at each backward pass) does the backward passes and
    optimizer steps; the step then updates the loss scale once and counts the schedulers' step (which the module
    steps itself, as in Lightning)."""

    reduced = False  # True under FSDP: the wrapper's own gradient reduction stays on

    def __call__(self, window: list, loop: Any = None) -> None:
        hooks = loop.callbacks if loop is not None else None
        keep = hooks is not None and hooks.has("on_train_batch_end")
        self.outputs = []
        for batch in window:  # one micro-batch: accumulation is refused before launch
            with self.strategy.backward_sync(self.wrapped, enabled=self.reduced):
                out = self.strategy.training_step(self.wrapped, self.strategy.batch_to_device(batch), False)
            self.accumulate(out)
            if keep:
                self.outputs.append(out)
        self.precision.update_scale()
        self.scheduler.step()


def install(loop: Any, view: Any, module: Any) -> None:
    """Manual optimization's objects: the loop's step, the module's optimizers(), manual_backward() and
    clip_gradients(), and schedulers the module steps itself."""
    from runner.strategies.fsdp import FSDPStrategy

    precision, reduced = loop.precision, isinstance(loop.strategy, FSDPStrategy)
    manual = [ManualOptimizer(optimizer, loop, module, reduced) for optimizer in optimizers_of(loop.optimizer)]
    by_optimizer = {id(m.optimizer): m for m in manual}

    def optimizers(use_pl_optimizer: bool = True) -> Any:
        found = manual if use_pl_optimizer else [m.optimizer for m in manual]
        return found[0] if len(found) == 1 else list(found)

    def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        precision.backward(loss, *args, **kwargs)

    def clip_gradients(optimizer: Any, gradient_clip_val: Optional[float] = None,
                       gradient_clip_algorithm: Optional[str] = None) -> None:
        """Lightning's self.clip_gradients(opt, value, "norm" | "value") on the gradients averaged over processes."""
        target = by_optimizer.get(id(getattr(optimizer, "optimizer", optimizer)))
        if target is None or not gradient_clip_val:
            return
        target.sync()
        precision.unscale_gradients(target.optimizer)
        parameters = [p for group in target.param_groups for p in group["params"]]
        if (gradient_clip_algorithm or "norm").lower() == "value":
            torch.nn.utils.clip_grad_value_(parameters, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(parameters, gradient_clip_val)

    module.optimizers, module.manual_backward, module.clip_gradients = optimizers, manual_backward, clip_gradients
    loop.train_step = ManualStep(loop.strategy, loop.task, loop.wrapped, loop.optimizer, loop.scheduler, loop.metrics,
                                 loop.train.batch_size, loop.schedule.accumulate, loop.cfg)
    loop.train_step.reduced = reduced
    loop.task.task.manual = True
    if hasattr(loop.scheduler, "manual"):
        loop.scheduler.manual = True


def manual_problems(module: Any, cfg: Any) -> list[str]:
    """What manual optimization cannot be run with, one line each (Lightning refuses the same settings)."""
    if not is_manual(module):
        return []
    name, trainer = type(module).__name__, cfg.trainer
    lines = []
    if int(trainer.get("accumulate_grad_batches", 1)) > 1:
        lines.append(f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}: model ({name}) uses manual "
                     "optimization; accumulate in training_step (step the optimizers every N batches), as in Lightning")
    if trainer.get("gradient_clip_val") is not None:
        lines.append(f"trainer.gradient_clip_val={trainer.gradient_clip_val}: model ({name}) uses manual "
                     "optimization; call self.clip_gradients(opt, gradient_clip_val=..., gradient_clip_algorithm="
                     "'norm') in training_step, as in Lightning")
    if trainer.get("skip_nonfinite_loss"):
        lines.append(f"trainer.skip_nonfinite_loss=true: model ({name}) uses manual optimization, whose "
                     "training_step steps the optimizers itself; skip a bad batch there")
    return lines

