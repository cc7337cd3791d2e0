"""Where the worker hands Lightning's objects their trainer view: the LightningModule before it is wrapped (its
setup(stage) and configure_model()), then the loop's hooks for the module and the Lightning callbacks."""

from __future__ import annotations

import functools
import logging
from typing import Any

from runner.config import ConfigError
from runner.lightning.checks import module_problems
from runner.lightning.detect import is_lightning_callback, is_lightning_module, overrides
from runner.lightning.manual import install as install_manual, is_manual, manual_problems
from runner.lightning.optimizers import LightningSchedules, configured_by, hyperparameters
from runner.lightning.trainer_view import TrainerView

log = logging.getLogger("runner")
HOOKS_NAME = "lightning"  # the runner callback's name, and its key in a checkpoint's callbacks


def setup_module(model: Any, view: TrainerView) -> None:
    """A LightningModule gets the view as `self.trainer`, then its setup(stage) and configure_model() run, before
    the strategy moves and wraps it (Lightning's order). Other models are left as they are."""
    if not is_lightning_module(model):
        return
    # Also when no check ran before (torchrun, srun, runner.fit).
    problems = module_problems(model, view._stage) + manual_problems(model, view._cfg)
    if problems:
        raise ConfigError(problems)
    if view.is_global_zero:
        log.info(configured_by(model))
    view.attach_module(model)
    model.trainer = view  # Lightning's setter: the module's LightningModule children too
    for hook, args in (("setup", (view._stage,)), ("configure_model", ())):
        if overrides(model, hook):
            getattr(model, hook)(*args)


# The config groups a LightningModule's run does not use (its steps and configure_optimizers() replace them).
UNUSED_GROUPS = ("task", "optimizer", "scheduler")


def _what_runs(hparams: dict, optimizer: Any, configs: list) -> None:
    """The run's hyperparameters name what runs: the groups a LightningModule does not use go, and what its
    configure_optimizers() gave comes in their place."""
    for key in [key for key in hparams if key.split(".")[0] in UNUSED_GROUPS]:
        del hparams[key]
    hparams.update(hyperparameters(optimizer, configs))


def _configure_over(model: Any, view: TrainerView, steps: int) -> Any:
    """configure_optimizers() with trainer.estimated_stepping_batches = `steps` (a schedule made afresh over the steps
    a resumed run has left); the view says the run's own count again afterwards."""
    total = view._total_steps
    view.plan(steps)
    try:
        return model.configure_optimizers()
    finally:
        view._total_steps = total


def attach(loop: Any, view: TrainerView) -> None:
    """The view follows the loop; a LightningModule and the Lightning callbacks get their hooks (one runner callback
    that calls them), the module's self.log, and the optimizer and schedulers its configure_optimizers() gave."""
    from runner.lightning.hooks import LightningHooks
    from runner.lightning.task import LightningTask

    view.attach_loop(loop)
    model = loop.strategy.unwrap(loop.wrapped).model
    by_name = loop.callbacks.by_name
    callbacks = {name: callback for name, callback in by_name.items() if is_lightning_callback(callback)}
    lightning = is_lightning_module(model)
    if lightning and not isinstance(loop.task.task, LightningTask):
        raise ConfigError([f"model ({type(model).__name__}) is a LightningModule built by a function: name its class "
                           "as model._target_, so that its steps are the task"])
    if not (lightning or callbacks):
        return
    for name in callbacks:
        del by_name[name]
    hooks = LightningHooks(view, loop, model, callbacks)
    by_name[HOOKS_NAME] = hooks
    if lightning:
        # The strategy moved the module inside the runner's wrapper, which Lightning's `to` never saw: where it is
        # now (a no-op move) is what self.device says.
        model.to(loop.strategy.root_device)
        loop.task.task.hooks = hooks
        model.log, model.log_dict = hooks.recorder.log, hooks.recorder.log_dict
        model.optimizers = lambda use_pl_optimizer=True: loop.optimizer
        configs = loop.scheduler.configs if isinstance(loop.scheduler, LightningSchedules) else []
        view.attach_optimizer(loop.optimizer, configs)
        _what_runs(loop.hparams, loop.optimizer, configs)
        if isinstance(loop.scheduler, LightningSchedules):
            loop.scheduler.configure = functools.partial(_configure_over, model, view)
        if is_manual(model):
            install_manual(loop, view, model)
    hooks.setup_callbacks(view._stage)
