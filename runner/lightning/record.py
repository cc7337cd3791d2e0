"""`self.log` and `self.log_dict` of a LightningModule (and `pl_module.log` in a Lightning callback), in the runner's
terms: each value with the weight it is averaged with, taken by the step or hook that runs, and for evaluation summed
over its batches and processes exactly.

Lightning's own `log` reads its Trainer's result collection; the runner binds these methods on the module instead
(instance attributes, so the module's class and its state_dict are untouched).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from runner.tasks.base import BatchError

_MEANS = ("mean", "avg", torch.mean)


def is_torchmetric(value: Any) -> bool:
    """A torchmetrics Metric, told by its classes (torchmetrics is imported by the user's module, not here); the
    answer is kept per class (self.log asks at every step)."""
    kind = type(value)
    found = _METRIC_CLASSES.get(kind)
    if found is None:
        found = _METRIC_CLASSES[kind] = any(c.__name__ == "Metric" and (c.__module__ or "").startswith("torchmetrics")
                                            for c in kind.__mro__)
    return found


_METRIC_CLASSES: dict[type, bool] = {}


@dataclass
class Logged:
    """One `self.log` call: a value (a float tensor, a number, or a torchmetrics Metric), and its batch_size=."""

    value: Any
    batch_size: Optional[int]


class LogRecorder:
    """Takes `self.log` calls while a step or a hook whose values the runner uses runs (`recording`), else refuses
    them by the hook's name, so that no logged value is silently dropped."""

    def __init__(self) -> None:
        self.where: Optional[str] = None  # "train", "val", "test" while recording
        self.hook = "this hook"  # the running hook, for a refusal
        self.values: dict[str, Logged] = {}
        self.batch_size: Optional[int] = None  # the last batch_size= given while recording

    @contextlib.contextmanager
    def recording(self, where: Optional[str], hook: str) -> Iterator[dict[str, Logged]]:
        """While it lasts, `log` collects into the dict it gives (names as the user wrote them)."""
        saved = (self.where, self.hook, self.values, self.batch_size)
        self.where, self.hook, self.values, self.batch_size = where, hook, {}, None
        try:
            yield self.values
        finally:
            self.where, self.hook, self.values, self.batch_size = saved

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: Optional[bool] = None,
            on_step: Optional[bool] = None, on_epoch: Optional[bool] = None, reduce_fx: Any = "mean",
            enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
            add_dataloader_idx: bool = True, batch_size: Optional[int] = None, metric_attribute: Optional[str] = None,
            rank_zero_only: bool = False) -> None:
        """Lightning's signature. The runner averages every value weighted by its batch size, over the training log
        window or the whole evaluation and over every process (on_step, on_epoch, sync_dist change nothing)."""
        if self.where is None:
            raise BatchError(f"self.log({name!r}) in {self.hook}: the runner takes self.log in training_step (train/* "
                             "averaged over each log window), validation_step and test_step, and in on_train_batch_"
                             "start, on_validation_epoch_start/end and the validation/test batch hooks; log the value "
                             "from one of those")
        if reduce_fx not in _MEANS:
            raise BatchError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): the runner averages logged values "
                             "(reduce_fx='mean'); log the value to average, or compute the reduction yourself")
        if batch_size is not None:
            self.batch_size = int(batch_size)
        if not isinstance(name, str) or not name:
            raise BatchError(f"self.log({name!r}): a metric's name must be a non-empty string")
        if not is_torchmetric(value):
            value = _scalar(name, value)
        self.values[name] = Logged(value, None if batch_size is None else int(batch_size))

    def log_dict(self, dictionary: Any, **settings: Any) -> None:
        items = dictionary.items() if hasattr(dictionary, "items") else ()
        for name, value in items:
            self.log(str(name), value, **settings)


def _scalar(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise BatchError(f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; log one number")
        value = value.detach()
        return value if value.dtype == torch.float32 and not value.dim() else value.reshape(()).float()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise BatchError(f"self.log({name!r}) got {type(value).__name__}; log a number, a one-element tensor or a "
                     "torchmetrics Metric")


def metric_paths(module: torch.nn.Module) -> dict[int, str]:
    """id(metric) -> its attribute path in the module, for each torchmetrics Metric the module holds."""
    return {id(m): name for name, m in module.named_modules() if name and is_torchmetric(m)}


class Evaluation:
    """One validation's (or test's) logged values on this process: weighted sums of numbers, and the Metric objects
    logged, by name. `reduce` gives the values over every process (every process calls it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}  # name -> [value x weight, weight] (float64)
        self.metrics: dict[str, str] = {}  # name -> the Metric's attribute path in the module
        self.batches = 0

    def add(self, logged: dict[str, Logged], weight: Optional[int], module: torch.nn.Module) -> None:
        """A batch's values, each weighted by its batch_size= or `weight` (None: 1, a value logged outside a batch)."""
        paths: Optional[dict[int, str]] = None
        for name, item in logged.items():
            if is_torchmetric(item.value):
                paths = metric_paths(module) if paths is None else paths
                if id(item.value) not in paths:
                    raise BatchError(f"self.log({name!r}) got a torchmetrics Metric that is not an attribute of the "
                                     "module; assign it in __init__ (self.val_acc = Accuracy(...)) so that every "
                                     "process computes it at the epoch's end")
                self.metrics[name] = paths[id(item.value)]
                continue
            w = float(item.batch_size if item.batch_size is not None else (weight or 1))
            slot = self.sums.get(name)
            if slot is None:
                slot = self.sums[name] = torch.zeros(2, dtype=torch.float64, device=self.device)
            value = item.value.to(self.device, torch.float64) if isinstance(item.value, torch.Tensor) else item.value
            slot[0] += value * w
            slot[1] += w

    def reduce(self, strategy: Any, module: torch.nn.Module) -> dict[str, float]:
        """{name: value} over every process: weighted means of the numbers, Metric objects computed (they sync
        themselves) and reset. The names are global rank 0's (a process without batches logged none)."""
        mine = (list(self.sums), dict(self.metrics))
        names, metrics = strategy.broadcast(mine, src=0) if strategy.world_size > 1 else mine
        extra = sorted((set(self.sums) - set(names)) | (set(self.metrics) - set(metrics)))
        if extra:
            raise BatchError(f"self.log: process {strategy.global_rank} logged {extra}, which global rank 0 did not; "
                             "log the same names on every process")
        values: dict[str, float] = {}
        if names:
            zero = torch.zeros(2, dtype=torch.float64, device=self.device)
            table = torch.stack([self.sums.get(name, zero) for name in names])
            table = strategy.all_reduce(table, reduce_op="sum") if strategy.world_size > 1 else table
            values = {name: float(s / w) for name, (s, w) in zip(names, table.tolist()) if w > 0}
        for name, path in metrics.items():
            metric = module.get_submodule(path)
            values[name] = float(metric.compute())
            metric.reset()
        return values
