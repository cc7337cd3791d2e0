"""What Lightning code reads as `self.trainer`: a view of the runner's strategy, config and loop (no Lightning import).

A LightningDataModule, a LightningModule and a Lightning callback get this one object as their `trainer`. It answers
the questions they ask a Trainer (how many processes, which rank, which epoch, which step) from the objects the
runner built, and nothing else: an attribute outside the list raises an AttributeError naming it and what is there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch

# What the view answers, in the order an AttributeError lists them.
ATTRIBUTES = (
    "world_size", "global_rank", "local_rank", "node_rank", "num_devices", "num_nodes", "is_global_zero",
    "max_epochs", "max_steps", "current_epoch", "global_step", "datamodule", "precision", "accumulate_grad_batches",
    "sanity_checking", "training", "validating", "testing", "predicting", "log_dir", "default_root_dir",
    "should_stop", "model", "lightning_module", "strategy", "optimizers", "lr_scheduler_configs",
    "callback_metrics", "logged_metrics", "estimated_stepping_batches", "num_training_batches", "logger", "loggers",
    "progress_bar_callback",
)


class TrainerView:
    """Lightning's Trainer as the runner's objects answer it, for one process.

    Built by the worker from the config and the strategy before anything else, so a data module's prepare_data()
    and setup() read it; the loop, the module and the optimizer are added as they are built. `should_stop` is the
    one attribute Lightning code may set: the runner then stops every process after the step (a vote over them).
    """

    _INTERNAL = ("_cfg", "_strategy", "_run_dir", "_stage", "_loop", "_module", "_datamodule", "_optimizers",
                 "_scheduler_configs", "_total_steps", "_evaluating", "_should_stop")

    def __init__(self, cfg: Any, strategy: Any = None, run_dir: Any = None) -> None:
        self._cfg, self._strategy = cfg, strategy
        self._run_dir = Path(run_dir) if run_dir is not None else Path.cwd()
        self._stage: str = str(cfg.get("stage", "fit"))
        self._loop: Any = None
        self._module: Any = None
        self._datamodule: Any = None
        self._optimizers: list = []
        self._scheduler_configs: list = []
        self._total_steps: Optional[int] = None
        self._evaluating: Optional[str] = None  # "val" or "test" while the loop evaluates
        self._should_stop = False

    # -- what the runner sets ------------------------------------------------------------------------------
    def attach_loop(self, loop: Any) -> None:
        self._loop = loop

    def attach_module(self, module: Any) -> None:
        self._module = module

    def attach_datamodule(self, datamodule: Any) -> None:
        self._datamodule = datamodule

    def attach_optimizer(self, optimizer: Any, scheduler_configs: list) -> None:
        from runner.loop.optimizers import optimizers_of

        # The schedules' own list: trainer.resume=new_schedule replaces its schedulers in place.
        self._optimizers, self._scheduler_configs = optimizers_of(optimizer), scheduler_configs

    def plan(self, total_steps: int) -> None:
        """The optimizer steps the run takes (estimated_stepping_batches), once the worker knows them."""
        self._total_steps = int(total_steps)

    def evaluating(self, split: Optional[str]) -> None:
        self._evaluating = split

    # -- processes -----------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._strategy.world_size if self._strategy is not None else 1

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank if self._strategy is not None else 0

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank if self._strategy is not None else 0

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank if self._strategy is not None else 0

    @property
    def num_devices(self) -> int:
        return len(getattr(self._strategy, "parallel_devices", None) or [None])

    @property
    def num_nodes(self) -> int:
        return int(self._cfg.trainer.get("num_nodes", 1))

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def strategy(self) -> Any:
        """The runner's strategy: Lightning's names for what a step may need (reduce, barrier, broadcast,
        all_reduce, root_device, reduce_boolean_decision)."""
        return self._strategy

    # -- the run's plan and position -----------------------------------------------------------------------
    @property
    def max_epochs(self) -> Optional[int]:
        if self._loop is not None:
            value = self._loop.schedule.max_epochs
            return -1 if value == math.inf else int(value)
        value = self._cfg.trainer.get("max_epochs")
        return value

    @property
    def max_steps(self) -> int:
        return int(self._cfg.trainer.get("max_steps", -1))

    @property
    def current_epoch(self) -> int:
        return self._loop.progress.epoch if self._loop is not None else 0

    @property
    def global_step(self) -> int:
        return self._loop.progress.step if self._loop is not None else 0

    @property
    def accumulate_grad_batches(self) -> int:
        return int(self._cfg.trainer.get("accumulate_grad_batches", 1))

    @property
    def precision(self) -> str:
        return str(getattr(getattr(self._strategy, "precision", None), "precision", None)
                   or self._cfg.get("precision", {}).get("precision", "32-true"))

    @property
    def estimated_stepping_batches(self) -> int:
        if self._total_steps is None:
            raise AttributeError("trainer.estimated_stepping_batches is known once the training data is ready: read "
                                 "it in configure_optimizers() or later, not in __init__ or setup()")
        return self._total_steps

    @property
    def num_training_batches(self) -> float:
        """Micro-batches per epoch on this process (Lightning's count, after limit_train_batches)."""
        return self._loop.schedule.batches_per_epoch if self._loop is not None else math.inf

    @property
    def sanity_checking(self) -> bool:
        return False  # the runner validates no batches before training

    @property
    def training(self) -> bool:
        return self._stage == "fit" and self._evaluating is None

    @property
    def validating(self) -> bool:
        return self._evaluating == "val"

    @property
    def testing(self) -> bool:
        return self._evaluating == "test"

    @property
    def predicting(self) -> bool:
        return self._stage == "predict"

    @property
    def should_stop(self) -> bool:
        return self._should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._should_stop = bool(value)

    # -- objects ---------------------------------------------------------------------------------------------
    @property
    def datamodule(self) -> Any:
        return self._datamodule

    @property
    def model(self) -> Any:
        return self._module

    @property
    def lightning_module(self) -> Any:
        return self._module

    @property
    def optimizers(self) -> list:
        return list(self._optimizers)

    @property
    def lr_scheduler_configs(self) -> list:
        return list(self._scheduler_configs)

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The last reduced value of every metric the run logged (train/*, val/*, lr, ...), as tensors."""
        metrics = self._loop.progress.metrics if self._loop is not None else {}
        return {name: torch.tensor(value) for name, value in metrics.items() if isinstance(value, (int, float))}

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        return self.callback_metrics

    @property
    def log_dir(self) -> str:
        return str(self._run_dir)

    @property
    def default_root_dir(self) -> str:
        return str(self._run_dir)

    @property
    def logger(self) -> Any:
        """The first of `loggers` (None with logger=none), as Lightning's Trainer gives it."""
        loggers = self.loggers
        return loggers[0] if loggers else None

    @property
    def loggers(self) -> list:
        """The run's loggers, with Lightning's surface: `experiment` (TensorBoard's SummaryWriter, MLflow's client
        with `run_id`, the W&B run), log_metrics, log_hyperparams, save_dir, log_dir, name, version. On ranks other
        than 0 (and under trainer.fast_dev_run) one stands in for each, whose experiment does nothing."""
        logger = self._loop.logger if self._loop is not None else None
        found = list(getattr(logger, "loggers", None) or ([logger] if logger is not None else []))
        return [one for one in found if getattr(one, "stands_in", True)]  # logger=none: no logger

    @property
    def progress_bar_callback(self) -> None:
        return None  # LightningModule.print() then prints on global rank 0

    # -- anything else -----------------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Called only for names the class does not define: say what the view has instead of a bare AttributeError.
        raise AttributeError(f"trainer.{name}: the runner's trainer view has no attribute {name!r}; it has "
                             f"{', '.join(ATTRIBUTES)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._INTERNAL or name == "should_stop":
            object.__setattr__(self, name, value)
            return
        raise AttributeError(f"trainer.{name} cannot be set: the runner's trainer view takes only should_stop "
                             "(set it to True to stop the run after this step)")

    def __repr__(self) -> str:
        return (f"TrainerView(world_size={self.world_size}, global_rank={self.global_rank}, "
                f"global_step={self.global_step}, current_epoch={self.current_epoch})")


def attach_to_data(view: Optional[TrainerView], data: Any) -> None:
    """`data.trainer = view` for a data object that has a `trainer` attribute (a LightningDataModule has one, None
    until a Trainer sets it), before its prepare_data() and setup() run."""
    from runner.lightning.detect import is_lightning_datamodule

    if view is None or not (hasattr(data, "trainer") or is_lightning_datamodule(data)):
        return
    data.trainer = view
    view.attach_datamodule(data)
