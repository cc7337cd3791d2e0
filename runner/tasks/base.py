"""What every task shares: splitting a batch, calling the model, the module strategies wrap, and step weights.

A task turns one batch into the loss to back-propagate (a *sum* over the batch's units: samples, or tokens)
and a row of statistics the loop sums: samples, units, loss sum, then the task's own metric sums. Sums, not
means, so that any split of a global batch over processes and micro-batches weighs every unit equally.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from runner.tree import apply_to_tensors

# The first columns of every task's statistics row.
SAMPLES, UNITS, LOSS = 0, 1, 2
BASE_STATS = ("samples", "units", "loss")


class BatchError(ValueError):
    """A batch or a model output that does not fit the task; the message names the task key to change."""


def describe(value: Any) -> str:
    """A short description of a batch or an output for error messages: types and shapes, not values."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{type(value).__name__} of {len(value)} ({inner})"
    return type(value).__name__


def as_mapping(batch: Any) -> Optional[Mapping]:
    """A dict, a dataclass or a named tuple as a mapping of its fields; None for other batches."""
    if isinstance(batch, Mapping):
        return batch
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    if isinstance(batch, tuple) and hasattr(batch, "_asdict"):
        return batch._asdict()
    return None


def split_batch(batch: Any, target_key: str, task: str) -> tuple[Any, Any]:
    """(inputs, targets) of an `(inputs, targets)` pair, or of a dict-like batch holding `target_key`."""
    fields = as_mapping(batch)
    if fields is not None and target_key in fields:
        return {k: v for k, v in fields.items() if k != target_key}, fields[target_key]
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise BatchError(
        f"task={task} takes batches of (inputs, targets) or dicts with the targets under "
        f"task.target_key={target_key!r}; the data gave {describe(batch)}")


def call_model(model: nn.Module, inputs: Any) -> Any:
    """`model(**inputs)` for dict inputs (keyword arguments, as HuggingFace models take them), else `model(inputs)`."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def field(output: Any, name: str) -> Any:
    """`output[name]` of a dict-like output or `output.name` of an object; None when it has neither."""
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def logits_of(output: Any, task: str) -> torch.Tensor:
    """The prediction tensor of a model output: the tensor itself, or its `logits` (dicts and HF-style outputs)."""
    found = output if isinstance(output, torch.Tensor) else field(output, "logits")
    if not isinstance(found, torch.Tensor):
        raise BatchError(f"task={task} needs the model to return a tensor (or a dict or object with 'logits'); "
                         f"it returned {describe(output)} (a model computing its own loss runs under task=model)")
    return found


def leading_size(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor."""
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor):  # a tensor, or a pair of them: no walk over the batch
        return first.shape[0] if first.dim() else 1
    sizes: list[int] = []
    apply_to_tensors(batch, lambda t: sizes.append(t.shape[0] if t.dim() else 1))
    if not sizes:
        raise BatchError(f"a batch holds no tensor: {describe(batch)}")
    return sizes[0]


def stats_row(*columns: Union[torch.Tensor, float]) -> torch.Tensor:
    """One (1, K) row from tensors (detached) and plain numbers, on the tensors' device: float32, or float64 where a
    tensor is (64-true keeps its statistics at its own precision).

    Consecutive numbers become one small tensor: one host-to-device copy, not one per number.
    """
    tensors = [c for c in columns if isinstance(c, torch.Tensor)]
    device = tensors[0].device
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    parts: list[torch.Tensor] = []
    numbers: list[float] = []
    for column in columns:
        if isinstance(column, torch.Tensor):
            if numbers:
                parts.append(numbers_tensor(numbers, device, dtype))
                numbers = []
            parts.append(column.detach().to(dtype).reshape(1))
        else:
            numbers.append(float(column))
    if numbers:
        parts.append(numbers_tensor(numbers, device, dtype))
    return torch.cat(parts).reshape(1, -1)


def numbers_tensor(numbers: list, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float32 (or float64) tensor of plain numbers on `device`; on the CPU through a C array (half torch.tensor's
    cost per step), elsewhere one host-to-device copy. The caller copies it on (cat): the tensor shares the array's
    memory."""
    if device.type == "cpu":
        return torch.frombuffer(array.array("d" if dtype == torch.float64 else "f", numbers), dtype=dtype)
    return torch.tensor(numbers, dtype=dtype, device=device)


def plural(unit: str) -> str:
    """`tokens` for the unit `token`, for throughput/<units>_per_s; a unit given as a plural stays as it is."""
    return unit if unit.endswith("s") else f"{unit}s"


class Task:
    """The interface the loop and `TaskModule` use. Subclasses: classification, regression, language_model, model.

    `fixed_units`: every training micro-batch holds `data.batch_size` units (samples), so a step's unit count
    is known without communication. Otherwise `units(batch)` counts them before the forward pass (tokens),
    or returns None when only the model knows (task=model with a `count`).
    """

    name: str = "task"
    unit: str = "sample"
    fixed_units: bool = True
    extra_stats: tuple[str, ...] = ()
    takes_pairs: bool = False  # batches may be (inputs, targets) pairs, the model getting the inputs
    # True: forward's "loss" is {optimizer name: summed loss}, one per named optimizer (optimizer.<name>._params_),
    # each back-propagated into its optimizer's parameters only (the parts of a GAN, an actor and a critic).
    losses_per_optimizer: bool = False
    # Set by the loop around a forward whose output it discards (a padding forward, for the other processes'
    # collectives under FSDP): a task with side effects (a LightningModule's self.log and hooks) skips them.
    discard: bool = False

    @property
    def stat_names(self) -> tuple[str, ...]:
        return BASE_STATS + self.extra_stats

    def forward(self, model: nn.Module, batch: Any, precision: Any, with_preds: bool) -> dict[str, Any]:
        raise NotImplementedError

    def units(self, batch: Any) -> Optional[int]:
        raise NotImplementedError

    def compute(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric values (without the `train/`/`val/` prefix) from the statistics summed over processes."""
        raise NotImplementedError


class TaskModule(nn.Module):
    """The module every strategy wraps: the user's model with its task.

    forward(batch) -> {"loss": summed over the batch's units, "stats": (1, K) row[, "preds", "target"]}.
    Precision's autocast is entered inside forward, because autocast is thread-local and DataParallel runs
    its replicas in threads.
    """

    def __init__(self, model: nn.Module, task: Task, precision: Any) -> None:
        super().__init__()
        self.model, self.task, self.precision = model, task, precision

    def forward(self, batch: Any, with_preds: bool = False) -> dict[str, Any]:
        return self.task.forward(self.model, batch, self.precision, with_preds)

    def predict(self, batch: Any) -> torch.Tensor:
        """The model's predictions (logits) for a batch of inputs; any targets in it are left out. A task with a
        predict step of its own (a LightningModule's predict_step) gives its output instead."""
        if getattr(self.task, "predicts", None) is not None and self.task.predicts(self.model):
            return self.task.predict(self.model, batch, self.precision)
        fields = as_mapping(batch)
        target_key = getattr(self.task, "target_key", "labels")
        if fields is not None and target_key in fields:
            batch = {k: v for k, v in fields.items() if k != target_key}
        elif fields is None and isinstance(batch, (list, tuple)) and len(batch) == 1:
            batch = batch[0]  # samples of one tensor each (a TensorDataset of inputs): the model gets the tensor
        elif fields is None and isinstance(batch, (list, tuple)) and len(batch) == 2 and self.task.takes_pairs:
            batch = batch[0]  # (inputs, targets), as in training: the model gets the inputs
        with self.precision.forward_context():
            output = call_model(self.model, self.precision.convert_input(batch))
        preds = output if isinstance(output, torch.Tensor) else field(output, getattr(self.task, "preds_key", "logits"))
        if not isinstance(preds, torch.Tensor):
            raise BatchError(f"stage=predict: the model returned {describe(output)}; predictions need a tensor "
                             "(or a dict or object with 'logits')")
        return self.precision.convert_output(preds).detach()

    @staticmethod
    def batch_loss(out: dict[str, Any]) -> Any:
        """The summed loss to back-propagate, also when DataParallel gathered one sum per device; a dict of them
        for a task with one loss per optimizer."""
        loss = out["loss"]
        if isinstance(loss, Mapping):
            return {name: value if value.dim() == 0 else value.sum() for name, value in loss.items()}
        return loss if loss.dim() == 0 else loss.sum()


class StepWeights:
    """What each micro-batch's summed loss is multiplied by, so that an optimizer step follows the gradient
    of the mean over every unit of its global batch, however it is split over processes and micro-batches.

    DDP averages gradients over the W processes, so with N units in the step the factor is W / N:
    - samples (`fixed_units`): N = data.batch_size x W x accumulate, known without communication;
    - tokens counted from the batch: N is one all-reduce, started before the first forward pass and
      waited for at the first backward pass, as a device tensor (no host sync);
    - units only the model reports (`units` None): back-propagate with the sample factor, then rescale
      the gradients by (what that assumed) / N once the step's counts are reduced.
    """

    def __init__(self, task: Task, strategy: Any, batch_size: int, accumulate: int) -> None:
        self.task, self.strategy = task, strategy
        self.batch_size, self.accumulate = batch_size, accumulate
        self.sample_scale = 1.0 / (batch_size * accumulate)
        self._rescale = False

    def start(self, window: list) -> Callable[[], Any]:
        counts = [self.task.units(batch) for batch in window]
        self._rescale = None in counts
        if self._rescale:
            return lambda: self.sample_scale
        local = sum(counts)
        if self.task.fixed_units:
            if local != self.batch_size * self.accumulate:
                raise BatchError(f"a training step got {local} samples in {len(window)} micro-batch(es), not "
                                 f"data.batch_size={self.batch_size} each; a collate_fn must keep every sample")
            return lambda: self.sample_scale
        device = self.strategy.root_device
        # torch.full fills on the device: no host-to-device copy that could wait for the GPU.
        wait = self.strategy.start_all_reduce(torch.full((), float(local), device=device), reduce_op="sum")
        world = float(self.strategy.world_size)
        scale: list = []

        def get() -> torch.Tensor:
            if not scale:
                scale.append(world / wait().clamp_min(1.0))
            return scale[0]
        return get

    def units(self, stats: list[torch.Tensor], counts: Optional[list] = None) -> Optional[float]:
        """After the backward passes: the step's units over every process where they came from the model (None where
        they were known before). `counts`: the micro-batches' units as plain numbers, where the task gave them
        (out["unit_count"]): on one process no tensor is read back."""
        if not self._rescale:
            return None
        if counts and None not in counts and self.strategy.world_size == 1:
            return float(sum(counts))
        local = torch.cat(stats).double()[:, UNITS].sum()
        return float(self.strategy.all_reduce(local, reduce_op="sum"))

    def finish(self, parameters: Any, total: Optional[float]) -> None:
        """After unscaling: rescale the gradients where the units came from the model (`total`: `units()`)."""
        if total is None:
            return
        factor = self.strategy.world_size / (self.sample_scale * max(total, 1.0))
        if factor == 1.0:  # the common case (every unit counted as assumed): no list of gradients to build
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
