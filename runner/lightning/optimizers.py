"""A LightningModule's `configure_optimizers()` in the runner's terms: one optimizer, and its schedulers stepped as
Lightning steps them (every `frequency` optimizer steps or epochs, ReduceLROnPlateau with the metric it monitors).

Lightning's return forms: the optimizer; [optimizer, ...]; ([optimizer, ...], [scheduler, ...]); a dict with
`optimizer` and `lr_scheduler` (a scheduler, or a dict with `scheduler`, `interval`, `frequency`, `monitor`,
`strict`, `name`), or a list of such dicts. Several optimizers need manual optimization (as in Lightning 2); the
loop sees them as one OptimizerSet, and the module's training_step steps them (runner.lightning.manual).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from runner.config import ConfigError
from runner.lightning.detect import overrides

log = logging.getLogger("runner")
_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau")


@dataclass
class SchedulerConfig:
    """Lightning's LRSchedulerConfig: what `self.trainer.lr_scheduler_configs` and `self.lr_schedulers()` give."""

    scheduler: Any
    name: Optional[str] = None
    interval: str = "epoch"
    frequency: int = 1
    reduce_on_plateau: bool = False
    monitor: Optional[str] = None
    strict: bool = True


# The scheduler configs of each optimizer a module configured, for build_scheduler (which gets the optimizer only).
_CONFIGURED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[SchedulerConfig]]" = weakref.WeakKeyDictionary()


def configure(module: Any) -> Any:
    """The optimizer `module.configure_optimizers()` returns (several, under manual optimization, as one
    OptimizerSet); its schedulers are kept for `schedules_for`."""
    from runner.loop.optimizers import OptimizerSet

    what = f"{type(module).__name__}.configure_optimizers()"
    returned = module.configure_optimizers()
    optimizers, schedulers, monitor = _parse(returned, what)
    several_problem(len(optimizers), module, what)
    configs = [_config(item, monitor, what) for item in schedulers]
    for config in configs:
        if not any(getattr(config.scheduler, "optimizer", o) is o for o in optimizers):
            raise ConfigError([f"{what}: a scheduler ({type(config.scheduler).__name__}) steps another optimizer than "
                               "those returned"])
    optimizer = optimizers[0] if len(optimizers) == 1 else OptimizerSet(optimizers)
    _CONFIGURED[optimizer] = configs
    return optimizer


def several_problem(count: int, module: Any, what: str) -> None:
    """Several optimizers are Lightning's manual optimization (Lightning 2 refuses them otherwise too)."""
    if count > 1 and getattr(module, "automatic_optimization", True):
        raise ConfigError([f"{what} returned {count} optimizers with automatic optimization: set "
                           "self.automatic_optimization = False and step them in training_step (Lightning's manual "
                           "optimization), or use one optimizer with parameter groups"])


def _parse(returned: Any, what: str) -> tuple[list, list, Optional[str]]:
    """(the optimizers, their schedulers as returned, a dict's `monitor`) of any of Lightning's return forms."""
    if isinstance(returned, torch.optim.Optimizer):
        return [returned], [], None
    if isinstance(returned, Mapping):
        if not isinstance(returned.get("optimizer"), torch.optim.Optimizer):
            raise ConfigError([f"{what} returned a dict without an optimizer under 'optimizer'"])
        found = returned.get("lr_scheduler")
        return [returned["optimizer"]], [] if found is None else [found], returned.get("monitor")
    if isinstance(returned, Sequence) and not isinstance(returned, str) and returned:
        items = list(returned)
        if len(items) == 2 and all(isinstance(i, Sequence) and not isinstance(i, str) for i in items):
            optimizers, schedulers = list(items[0]), list(items[1])
        else:
            optimizers, schedulers = items, []
        if optimizers and all(isinstance(o, Mapping) for o in optimizers):
            parsed = [_parse(item, what) for item in optimizers]
            monitors = {m for _, _, m in parsed if m is not None}
            return ([o for found, _, _ in parsed for o in found], [s for _, found, _ in parsed for s in found]
                    + schedulers, monitors.pop() if len(monitors) == 1 else None)
        if optimizers and all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            return optimizers, schedulers, None
    raise ConfigError([f"{what} returned {type(returned).__name__}; return an optimizer, [optimizer, ...], "
                       "([optimizer, ...], [scheduler, ...]) or {'optimizer': ..., 'lr_scheduler': ...}"])


def _config(item: Any, monitor: Optional[str], what: str) -> SchedulerConfig:
    settings = dict(item) if isinstance(item, Mapping) else {"scheduler": item}
    unknown = sorted(set(settings) - set(_KEYS))
    if unknown or "scheduler" not in settings:
        raise ConfigError([f"{what}: an lr_scheduler dict takes {', '.join(_KEYS)} (with 'scheduler'); it has "
                           f"{', '.join(map(str, settings))}"])
    if monitor is not None and settings.get("monitor") is None:
        settings["monitor"] = monitor
    settings.setdefault("reduce_on_plateau", isinstance(settings["scheduler"],
                                                        torch.optim.lr_scheduler.ReduceLROnPlateau))
    config = SchedulerConfig(**settings)
    if config.interval not in ("step", "epoch"):
        raise ConfigError([f"{what}: lr_scheduler interval={config.interval!r} is not allowed: use 'step' or 'epoch'"])
    if not (isinstance(config.frequency, int) and config.frequency >= 1):
        raise ConfigError([f"{what}: lr_scheduler frequency={config.frequency!r} must be a positive integer"])
    if config.reduce_on_plateau and not config.monitor:
        raise ConfigError([f"{what}: {type(config.scheduler).__name__} needs the metric it watches: return "
                           "{'scheduler': ..., 'monitor': 'val/loss'}"])
    return config


def _rebind(scheduler: Any, owners: dict) -> None:
    """A scheduler made for a new optimizer steps the run's own instead (a SequentialLR's or ChainedScheduler's parts
    too)."""
    own = owners.get(id(getattr(scheduler, "optimizer", None)))
    if own is not None:
        scheduler.optimizer = own
    for part in getattr(scheduler, "_schedulers", ()):
        _rebind(part, owners)


def schedules_for(optimizer: Any) -> Optional["LightningSchedules"]:
    """The loop's scheduler for an optimizer a LightningModule configured; None for any other optimizer."""
    try:
        configs = _CONFIGURED.get(optimizer)
    except TypeError:  # not weakly referable: not one a module configured
        configs = None
    return None if configs is None else LightningSchedules(optimizer, configs)


class LightningSchedules:
    """What the loop steps after each optimizer step: the module's schedulers with interval 'step', every
    `frequency` steps; those with interval 'epoch' at each epoch's end (after the validation that closes it), every
    `frequency` epochs. ReduceLROnPlateau gets the value of its `monitor` (the run's last reduced value, the same on
    every process). The counters and each scheduler's state are in the checkpoint, so a resume continues exactly."""

    def __init__(self, optimizer: torch.optim.Optimizer, configs: list[SchedulerConfig]) -> None:
        self.optimizer, self.configs = optimizer, configs
        self.base_lrs = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
        self.steps = self.epochs = 0
        self.metrics: Callable[[], dict] = dict  # the run's reduced metrics (set when training starts)
        self.module: Any = None  # a module with lr_scheduler_step of its own steps the schedulers itself
        self.manual = False  # manual optimization: the module's training_step steps its schedulers (as in Lightning)
        self.configure: Callable[[int], Any] = lambda steps: None  # configure_optimizers() over `steps` (attach sets)

    @property
    def description(self) -> str:
        """What the lines about the schedule name: the module's own schedulers, or none."""
        parts = [f"{type(c.scheduler).__name__} (interval {c.interval}"
                 + (f", monitor {c.monitor})" if c.monitor else ")") for c in self.configs]
        return f"{', '.join(parts)} from configure_optimizers()" if parts else "no scheduler (configure_optimizers())"

    @property
    def monitors(self) -> list[tuple[str, str, str]]:
        """(metric, direction, whose) of each scheduler that watches a metric: the run's own monitors, which the
        objective follows when the user sets none (runner.callbacks.ObjectiveCheck)."""
        return [(config.monitor, "maximize" if getattr(config.scheduler, "mode", "min") == "max" else "minimize",
                 f"lr_scheduler monitor ({type(config.scheduler).__name__} from configure_optimizers())")
                for config in self.configs if config.monitor]

    def step(self) -> None:
        self._step("step", self.steps + 1)
        self.steps += 1

    def epoch_end(self) -> None:
        self._step("epoch", self.epochs + 1)
        self.epochs += 1

    def _step(self, interval: str, count: int) -> None:
        """Step the schedulers due at `count`; a monitor that is not logged is refused before any of them steps,
        so that the state a refusal saves is whole."""
        due = [config for config in (() if self.manual else self.configs)
               if config.interval == interval and not count % config.frequency]
        metrics = [self._monitored(config) if config.reduce_on_plateau else None for config in due]
        for config, metric in zip(due, metrics):
            if config.reduce_on_plateau and metric is None:
                continue
            if self.module is not None and overrides(self.module, "lr_scheduler_step"):
                self.module.lr_scheduler_step(config.scheduler, metric)
            elif config.reduce_on_plateau:
                config.scheduler.step(metric)
            else:
                config.scheduler.step()

    def _monitored(self, config: SchedulerConfig) -> Optional[float]:
        metrics = self.metrics()
        if config.monitor in metrics:
            return float(metrics[config.monitor])
        logged = ", ".join(sorted(k for k in metrics if "/" in k)) or "none yet"
        if config.strict:
            raise ConfigError([f"lr_scheduler monitor={config.monitor!r} ({type(config.scheduler).__name__}) is not "
                               f"logged; the metrics are: {logged} (set 'strict': False to skip such steps)"])
        log.warning("lr_scheduler monitor=%r is not logged (the metrics are: %s): the scheduler is not stepped",
                    config.monitor, logged)
        return None

    def state_dict(self) -> dict:
        """The schedulers' states and counters; `configs` says how each is stepped (the checks before a resume read
        it: runner.schedulers.unreachable)."""
        return {"schedulers": [config.scheduler.state_dict() for config in self.configs],
                "base_lrs": list(self.base_lrs), "steps": self.steps, "epochs": self.epochs,
                "configs": [{"class": type(config.scheduler).__name__, "frequency": config.frequency,
                             "interval": "manual" if self.manual else config.interval} for config in self.configs]}

    def restart(self, steps: int) -> None:
        """trainer.resume=new_schedule: the schedulers configure_optimizers() makes with estimated_stepping_batches
        the `steps` left (`configure`, set where the module is attached), taken over for the run's optimizers, which
        take the settings the new ones got (the configured ones, and what the schedulers set: initial_lr, max_lr)."""
        from runner.loop.optimizers import optimizers_of

        what = "configure_optimizers() for trainer.resume=new_schedule"
        made, schedulers, monitor = _parse(self.configure(steps), what)
        mine = optimizers_of(self.optimizer)
        if [len(o.param_groups) for o in made] != [len(o.param_groups) for o in mine]:
            raise ConfigError([f"{what} returned other optimizers or parameter groups than it did at the start"])
        for new, own in zip(made, mine):
            for group, settings in zip(own.param_groups, new.param_groups):
                group.update({key: value for key, value in settings.items() if key != "params"})
        owners = {id(new): own for new, own in zip(made, mine)}
        self.configs[:] = [_config(item, monitor, what) for item in schedulers]  # in place: the trainer view's list
        for config in self.configs:
            _rebind(config.scheduler, owners)
        self.base_lrs = [group.get("initial_lr", group["lr"]) for group in self.optimizer.param_groups]
        self.steps = self.epochs = 0

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("schedulers", [])
        if len(saved) != len(self.configs):
            raise ConfigError([f"trainer.ckpt_path: the checkpoint holds {len(saved)} learning-rate scheduler(s), "
                               f"configure_optimizers() returns {len(self.configs)}"])
        for config, scheduler_state in zip(self.configs, saved):
            config.scheduler.load_state_dict(scheduler_state)
        self.base_lrs = list(state.get("base_lrs", self.base_lrs))
        self.steps, self.epochs = int(state.get("steps", 0)), int(state.get("epochs", 0))


def hyperparameters(optimizer: Any, configs: list[SchedulerConfig]) -> dict[str, Any]:
    """What configure_optimizers() gave, as hyperparameters (`configure_optimizers.*`): each optimizer's class and
    constructor settings, each scheduler's class, interval and monitor."""
    from runner.loop.optimizers import optimizers_of

    found: dict[str, Any] = {}
    optimizers = optimizers_of(optimizer)
    for index, one in enumerate(optimizers):
        prefix = "configure_optimizers" + (f".{index}" if len(optimizers) > 1 else "")
        found[f"{prefix}.optimizer"] = type(one).__name__
        found.update({f"{prefix}.{key}": value if isinstance(value, (bool, int, float, str)) else str(value)
                      for key, value in one.defaults.items() if value is not None})
    for index, config in enumerate(configs):
        prefix = "configure_optimizers.scheduler" + (f".{index}" if len(configs) > 1 else "")
        found.update({prefix: type(config.scheduler).__name__, f"{prefix}.interval": config.interval,
                      f"{prefix}.frequency": config.frequency, **({f"{prefix}.monitor": config.monitor}
                                                               if config.monitor else {})})
    return found


def configured_by(module: Any) -> str:
    """The one line a run with a LightningModule logs about the config groups it does not use."""
    return (f"model ({type(module).__name__}) is a LightningModule: its training_step, validation_step, test_step and "
            "configure_optimizers() are used; the config's task, optimizer and scheduler groups are not")
