"""A LightningModule's own steps as the runner's task: `training_step` in training, `validation_step` and `test_step`
in evaluation, called inside TaskModule.forward, so the strategy's wrapper (DDP, FSDP) sees them as the forward pass.

Lightning's steps return the *mean* loss over their batch; the runner back-propagates sums. Each micro-batch's loss
is weighted by its batch size (the `batch_size=` a `self.log` call gave, else the batch's leading size), and the
runner scales the sums by the units of the whole optimizer step over every process, so 2 processes x B follow the
gradient 1 process x 2B follows. A training_step that returns None skips its micro-batch: it adds no loss and no
units, and the step follows the mean over the micro-batches that gave a loss (on every process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch
from torch import nn

from runner.lightning.record import Evaluation, Logged, is_torchmetric
from runner.tasks.base import BatchError, Task, describe, leading_size, numbers_tensor

SPLITS = ("val", "test")
STEPS = {"train": "training_step", "val": "validation_step", "test": "test_step"}
WEIGHT = "#weight"  # the column of a logged value's weight (its weighted sum is the column of its name)
LOSS_UNITS = "lightning_loss_units"  # the units of the training losses returned (none when a manual step returns none)


class NotTriedOnMeta(Exception):
    """A LightningModule's steps are not tried on the meta device before training: they may read the trainer, log
    torchmetrics objects, or call hooks that only a running worker has."""


def stripped(name: str, split: str) -> str:
    """A logged name without its split's prefix, which the loop adds back: `val/acc` and `acc` are both val/acc."""
    return name[len(split) + 1:] if name.startswith(split + "/") else name


class LightningTask(Task):
    """The task of a LightningModule: its steps, their `self.log` values as metrics, and Lightning's batch hooks.

    The hooks (runner.lightning.hooks.LightningHooks) are bound when the worker attaches them to the loop. The
    training metrics are what the first training step logs (every process agrees on rank 0's names); their columns
    follow `lightning_val` and `lightning_test`, which count the batches of an evaluation, so that `compute` knows,
    from sums every process shares, whether it closes a training log window, a validation or a test.
    """

    name = "lightning"
    unit = "sample"
    fixed_units = False  # the module's batch_size=, and micro-batches it skips, are known after its step only
    takes_pairs = True  # stage=predict gives the inputs of an (inputs, targets) pair to the module's forward

    def __init__(self) -> None:
        self.hooks: Any = None
        self._train_names: Optional[tuple[str, ...]] = None
        self.train_metrics: dict[int, Any] = {}  # Metric objects logged in training_step: reset at each epoch's end
        self.evaluations: dict[str, Evaluation] = {}
        self.split = "test"  # evaluation batches run validation_step between on_validation_start and its epoch end
        self.step_records: list = []  # (output, batch, batch_idx) of the step's micro-batches, for on_train_batch_end
        self.manual = False  # manual optimization: training_step back-propagates itself; its loss is only reported
        self.predicted = 0  # the batches predict_step was given on this process (its batch_idx)
        self._checked: Any = None  # the module whose steps were found runnable (hooks bound, not on the meta device)

    @property
    def stat_names(self) -> tuple[str, ...]:  # type: ignore[override]
        # The columns known as numbers first, those computed as tensors (the loss, the logged values) last: a row is
        # one small tensor of the numbers and one stack of the tensors (`_row`), not one piece per column.
        names = self._train_names or ()
        return ("samples", "units", "lightning_val", "lightning_test", LOSS_UNITS, *(n + WEIGHT for n in names),
                "loss", *names)

    def units(self, batch: Any) -> Optional[int]:
        return None  # counted from the step's output: the gradients are rescaled by the step's units (StepWeights)

    def forward(self, model: nn.Module, batch: Any, precision: Any, with_preds: Any) -> dict[str, Any]:
        if model is not self._checked:  # once per module: a parameter look-up per step costs
            first = next(model.parameters(), None)
            if self.hooks is None or (first is not None and first.is_meta):  # a trial build, a FLOP count
                raise NotTriedOnMeta("a LightningModule's steps run in the worker only, with its trainer and hooks")
            self._checked = model
        with precision.forward_context():
            batch = precision.convert_input(batch)
            return self._train(model, batch) if model.training else self._evaluate(model, batch)

    # -- training ------------------------------------------------------------------------------------------------
    def _train(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        hooks, recorder = self.hooks, self.hooks.recorder
        batch_idx = hooks.train_batch_index()
        for record in self.step_records:  # the step's earlier micro-batches end before this one starts (Lightning)
            hooks.call("on_train_batch_end", *record)
        self.step_records = []
        with recorder.recording("train", "training_step") as logged:
            hooks.before_train_batch(batch, batch_idx)
            output = model.training_step(batch, batch_idx)
            size = recorder.batch_size
        loss = _loss(output, "training_step", optional=True)
        samples = leading_size(batch)
        units = size if size is not None else samples
        names = self._learn(logged)
        weights, values = [], []
        for name in names:
            item = logged.get(name)
            value = None if item is None else self._train_value(name, item)
            weight = 0 if value is None else (item.batch_size if item.batch_size is not None else units)
            weights.append(weight)
            values.append(0.0 if value is None else value * weight)  # a tensor, or a number logged as one
        loss_units = 0 if loss is None else units
        if loss is None and self.manual:  # trained by the step itself, which reports no loss
            loss_sum = torch.zeros((), device=hooks.strategy.root_device)
        elif loss is None:  # nothing trained: no samples either, so a window of skipped batches keeps the last values
            loss_sum, units, samples = hooks.no_loss(model), 0, 0
        else:
            loss_sum = loss.float() * units  # Lightning's mean over the batch, weighted by its size: a sum
        if hooks.keeps_step_outputs:
            self.step_records.append((output, batch, batch_idx))
        return {"loss": loss_sum, "stats": _row([samples, units, 0, 0, loss_units, *weights], loss_sum, values),
                "unit_count": units}

    def _train_value(self, name: str, item: Logged) -> Any:
        """A logged training value; a torchmetrics Metric's is its value on this batch (what calling it returned)."""
        if not is_torchmetric(item.value):
            return item.value
        batch_value = getattr(item.value, "_forward_cache", None)
        if not isinstance(batch_value, torch.Tensor) or batch_value.numel() != 1:
            raise BatchError(f"self.log({name!r}, <{type(item.value).__name__}>) in training_step: call the metric on "
                             "the batch (self.metric(preds, target)) before logging it, so its value on the batch is "
                             "known; the runner averages it over each log window")
        self.train_metrics[id(item.value)] = item.value
        value = batch_value.detach()
        return value if value.dtype == torch.float32 and not value.dim() else value.float().reshape(())

    def _learn(self, logged: dict) -> tuple[str, ...]:
        """The training metrics, fixed by the first training step (rank 0's names on every process)."""
        if self._train_names is None:
            names = tuple(logged)
            strategy = self.hooks.strategy
            self._train_names = strategy.broadcast(names, src=0) if strategy.world_size > 1 else names
        new = [name for name in logged if name not in self._train_names]
        if new:
            raise BatchError(f"self.log({new[0]!r}) in training_step, first logged after the first training step; the "
                             f"training metrics are those the first step logs ({', '.join(self._train_names) or 'none'}"
                             "): log every name at every step (each is averaged over the log window)")
        return self._train_names

    def reset_train_metrics(self) -> None:
        for metric in self.train_metrics.values():
            metric.reset()

    # -- evaluation ----------------------------------------------------------------------------------------------
    def open(self, split: str) -> Evaluation:
        self.split = split
        self.evaluations[split] = Evaluation(self.hooks.strategy.root_device)
        return self.evaluations[split]

    def _evaluate(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        split, hooks, recorder = self.split, self.hooks, self.hooks.recorder
        if self.discard:  # a padding forward (FSDP's collectives): the step runs, and leaves no trace
            with recorder.recording(split, STEPS[split]), torchmetrics_kept(model):
                getattr(model, STEPS[split])(batch, 0)
            zero, count = torch.zeros((), device=hooks.strategy.root_device), len(self._train_names or ())
            return {"loss": zero, "stats": _row([0] * (5 + count), zero, [0.0] * count)}
        evaluation = self.evaluations.get(split)
        if evaluation is None:  # a test: the runner has no hook before its first batch
            evaluation = self.open(split)
            hooks.test_start()
        batch_idx, evaluation.batches = evaluation.batches, evaluation.batches + 1
        samples = leading_size(batch)
        prefix = "validation" if split == "val" else "test"
        with recorder.recording(split, STEPS[split]) as logged:
            hooks.call(f"on_{prefix}_batch_start", batch, batch_idx)
            output = getattr(model, STEPS[split])(batch, batch_idx)
            size = recorder.batch_size
            hooks.call(f"on_{prefix}_batch_end", output, batch, batch_idx)
        evaluation.add(logged, size if size is not None else samples, model)
        loss = _loss(output, STEPS[split], optional=True, strict=False)
        units = 0 if loss is None else (size if size is not None else samples)
        loss_sum = torch.zeros((), device=hooks.strategy.root_device) if loss is None else loss.float() * units
        flags = (1, 0) if split == "val" else (0, 1)
        count = len(self._train_names or ())
        return {"loss": loss_sum, "stats": _row([samples, units, *flags, units, *[0] * count], loss_sum, [0.0] * count)}

    # -- prediction ------------------------------------------------------------------------------------------------
    def predicts(self, model: nn.Module) -> bool:
        """Whether stage=predict calls the module's predict_step (when it has one of its own)."""
        from runner.lightning.detect import overrides

        return self.hooks is not None and overrides(model, "predict_step")

    def predict(self, model: nn.Module, batch: Any, precision: Any) -> torch.Tensor:
        """predict_step(batch, batch_idx) between on_predict_batch_start and _end (on_predict_start and
        on_predict_epoch_start before the first batch): a tensor with one row per sample of the batch."""
        hooks, batch_idx = self.hooks, self.predicted
        if self.discard:  # a padding forward (FSDP's collectives): no hooks, no count, its output dropped
            with precision.forward_context(), torchmetrics_kept(model):
                return model.predict_step(precision.convert_input(batch), batch_idx)
        if batch_idx == 0:
            hooks.call("on_predict_start")
            hooks.call("on_predict_epoch_start")
        self.predicted += 1
        with precision.forward_context():
            batch = precision.convert_input(batch)
            hooks.call("on_predict_batch_start", batch, batch_idx)
            output = model.predict_step(batch, batch_idx)
            hooks.call("on_predict_batch_end", output, batch, batch_idx)
        samples = leading_size(batch)
        if not (isinstance(output, torch.Tensor) and output.dim() > 0 and output.shape[0] == samples):
            raise BatchError(f"{type(model).__name__}.predict_step returned {describe(output)} for a batch of "
                             f"{samples}; stage=predict writes one prediction per sample: return a tensor whose first "
                             "dimension is the batch's")
        return precision.convert_output(output).detach()

    # -- logged values ---------------------------------------------------------------------------------------------
    def compute(self, sums: dict[str, float]) -> dict[str, float]:
        """A training log window's values, or a validation's or test's: every process calls this at the same point
        (the loop's sums are reduced), so an evaluation reduces its logged values here."""
        split = "val" if sums.get("lightning_val") else "test" if sums.get("lightning_test") else None
        if split is not None:
            return self._close(split, sums)
        loss_units = sums.get(LOSS_UNITS, 0.0)
        values = {"loss": sums["loss"] / loss_units} if loss_units > 0 else {}
        for name in self._train_names or ():
            weight = sums.get(name + WEIGHT, 0.0)
            if weight > 0:
                values[stripped(name, "train")] = sums[name] / weight
        return values

    def _close(self, split: str, sums: dict[str, float]) -> dict[str, float]:
        hooks = self.hooks
        if split == "test":
            hooks.test_epoch_end(self.evaluations.setdefault(split, Evaluation(hooks.strategy.root_device)))
        evaluation = self.evaluations.pop(split, None) or Evaluation(hooks.strategy.root_device)
        logged = evaluation.reduce(hooks.strategy, hooks.module)
        values = {stripped(name, split): value for name, value in logged.items()}
        if sums["units"] > 0 and "loss" not in values:  # the step's returned loss, where the module logs none
            values["loss"] = sums["loss"] / sums["units"]
        if split == "test":
            hooks.test_end()
        return values


@contextlib.contextmanager
def torchmetrics_kept(model: nn.Module) -> Iterator[None]:
    """The states of the module's torchmetrics objects as they were before: what a discarded step updated is undone."""
    metrics = [m for m in model.modules() if is_torchmetric(m)]
    saved = [({name: _copied(getattr(m, name)) for name in m._defaults}, m._update_count, m._computed)
             for m in metrics]
    try:
        yield
    finally:
        for metric, (states, count, computed) in zip(metrics, saved):
            for name, value in states.items():
                setattr(metric, name, value)
            metric._update_count, metric._computed = count, computed


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else [_copied(v) for v in value] if isinstance(
        value, list) else value


def _row(numbers: list, loss: torch.Tensor, values: list) -> torch.Tensor:
    """The (1, K) float32 statistics row of `stat_names`: the numbers, then the loss and the values (tensors, or
    numbers) on the loss's device, in three tensor operations however many values there are."""
    device = loss.device
    tensors = [loss.detach().float(), *(v.detach().float() if isinstance(v, torch.Tensor)
                                        else torch.tensor(float(v), device=device) for v in values)]
    return torch.cat((numbers_tensor(numbers, device), torch.stack(tensors))).reshape(1, -1)


def _loss(output: Any, step: str, optional: bool = False, strict: bool = True) -> Optional[torch.Tensor]:
    """The loss a step returned: a scalar tensor, or a dict's "loss"; None when the step returned None and that is
    `optional` (with strict=False: None for anything else too, an evaluation step's return being its own business)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    if not strict or (output is None and optional):
        return None
    raise BatchError(f"{step} returned {describe(output)}; return the loss (a scalar tensor), a dict with 'loss', or "
                     "None to skip the batch")
