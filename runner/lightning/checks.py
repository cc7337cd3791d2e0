"""What of a Lightning project the runner does not run, refused before any worker starts, one line each: hooks of a
LightningModule or a Lightning callback it never calls, several optimizers without manual optimization, Lightning's own
callbacks (which reach into Lightning's Trainer), and settings that mean nothing for a LightningModule."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Optional

from runner.lightning.detect import (is_lightning_callback, is_lightning_code, is_lightning_module, model_class,
                                     overrides, stock_base)

_STEPS = "the runner's step calls training_step, back-propagates the loss scaled to the global batch, then steps"
# A LightningModule's hooks the runner never calls, and why (refused when the module overrides them).
MODULE_REFUSED = {
    "optimizer_step": f"{_STEPS} the optimizer itself",
    "optimizer_zero_grad": f"{_STEPS} the optimizer and zeroes the gradients itself",
    "configure_gradient_clipping": "the runner clips with trainer.gradient_clip_val",
    "backward": f"{_STEPS}: it runs the backward pass",
    "on_before_backward": "the runner has no hook between a step and its backward pass",
    "on_after_backward": ("the runner has no hook after each backward pass; on_before_optimizer_step gets the step's "
                          "gradients, accumulated and synced over processes"),
    "on_before_zero_grad": "the runner has no hook before it zeroes the gradients",
    "transfer_batch_to_device": "the runner moves batches to the device (the data's collate_fn shapes a batch)",
    "on_before_batch_transfer": "the runner moves batches to the device (the data's collate_fn shapes a batch)",
    "on_after_batch_transfer": "the runner moves batches to the device (the data's collate_fn shapes a batch)",
    "configure_callbacks": "give callbacks in the config: +callbacks.<name>._target_=<class>",
    "configure_sharded_model": "strategy=fsdp shards the model",
    "prepare_data": "give the data as data= (a LightningDataModule's prepare_data runs as it is)",
    "train_dataloader": "give the data as data= (a LightningDataModule with train_dataloader() runs as it is)",
    "val_dataloader": "give the data as data= (a LightningDataModule with val_dataloader() runs as it is)",
    "test_dataloader": "give the data as data= (a LightningDataModule with test_dataloader() runs as it is)",
    "predict_dataloader": "give the data as data= (a LightningDataModule with predict_dataloader() runs as it is)",
    "on_validation_model_eval": "the runner puts the model in eval mode for evaluation itself",
    "on_validation_model_train": "the runner puts the model back in train mode itself",
    "on_validation_model_zero_grad": "the runner has no such hook",
    "on_test_model_eval": "the runner puts the model in eval mode for evaluation itself",
    "on_test_model_train": "the runner puts the model back in train mode itself",
    "tbptt_split_batch": "truncated back-propagation through time is not run (Lightning 2 removed it too)",
}
# Predict hooks the runner does not call (it calls predict_step, on_predict_start, on_predict_epoch_start and
# on_predict_batch_start/_end; predictions.pt is written after the last batch).
PREDICT = ("on_predict_end", "on_predict_epoch_end", "on_predict_model_eval")
# A Lightning callback's hooks the runner calls; any other Lightning hook a callback overrides is refused.
CALLBACK_HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
    "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_validation_start", "on_validation_end",
    "on_validation_epoch_start", "on_validation_epoch_end", "on_validation_batch_start", "on_validation_batch_end",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_start",
    "on_test_batch_end", "on_before_optimizer_step", "on_save_checkpoint", "on_load_checkpoint", "state_dict",
    "load_state_dict", "on_exception", "state_key")
# Those that need a LightningModule's steps (a plain model has no training_step for the runner to call them around).
NEEDS_STEPS = ("on_train_epoch_start", "on_train_batch_start", "on_train_batch_end", "on_validation_batch_start",
               "on_validation_batch_end", "on_test_start", "on_test_epoch_start", "on_test_epoch_end",
               "on_test_batch_start", "on_test_batch_end", "on_test_end")
# Lightning's own callbacks that runner/checks/keys.py does not name, and what the runner has instead.
_INSTEAD = {
    "StochasticWeightAveraging": "callbacks=ema (an average of the weights, kept in every checkpoint)",
    "WeightAveraging": "callbacks=ema (an average of the weights, kept in every checkpoint)",
    "EMAWeightAveraging": "callbacks=ema (an average of the weights, kept in every checkpoint)",
    "GradientAccumulationScheduler": "trainer.accumulate_grad_batches",
    "ThroughputMonitor": "throughput/samples_per_s and throughput/tflops_per_s, logged at each train log",
    "Timer": "trainer.max_steps or trainer.max_epochs",
}


def module_problems(model: Any, stage: str) -> list[str]:
    """Why the runner cannot run `model` (a LightningModule class or instance) as Lightning would, one line each."""
    name = (model if inspect.isclass(model) else type(model)).__name__
    lines = [f"model ({name}) overrides {hook}, which the runner does not call: {why}"
             for hook, why in MODULE_REFUSED.items() if overrides(model, hook)]
    if stage == "predict":
        lines += [f"model ({name}) overrides {hook}, which stage=predict does not call (it calls predict_step, "
                  "on_predict_start, on_predict_epoch_start and on_predict_batch_start/_end, then writes "
                  "predictions.pt)" for hook in PREDICT if overrides(model, hook)]
    if not inspect.isclass(model):
        if getattr(model, "truncated_bptt_steps", 0):
            lines.append(f"model ({name}) sets truncated_bptt_steps: truncated back-propagation through time is "
                         "not run")
    return lines


def optimizer_problems(model: Any) -> list[str]:
    """configure_optimizers() on the module built on the meta device (skipped when it needs a running trainer)."""
    from runner.config import ConfigError
    from runner.lightning.optimizers import _parse, several_problem

    what = f"{type(model).__name__}.configure_optimizers()"
    try:
        returned = model.configure_optimizers()
    except Exception:  # noqa: BLE001 - it may read self.trainer: the worker calls it with one, and says why it fails
        return []
    try:
        several_problem(len(_parse(returned, what)[0]), model, what)
    except ConfigError as error:
        return list(error.problems)
    return []


def callback_problems(key: str, callback: type, lightning_model: bool, stage: str) -> list[str]:
    """Why the runner cannot run the Lightning callback class `callback` configured under `key`."""
    from runner.lightning.stock import lightning_class

    base = stock_base(callback, "Callback")
    if base is not None:
        target = f"{base.__module__}.{base.__name__}"
        named = lightning_class(key, target)
        if named is not None:
            return [] if base is callback else [f"{named} ({callback.__name__} derives from it)"]
        instead = _INSTEAD.get(base.__name__)
        return [f"{key}: {callback.__module__}.{callback.__name__} is {'' if base is callback else 'derived from '}"
                f"Lightning's own {base.__name__}, which reaches into Lightning's Trainer; the runner does not run it"
                + (f"; the runner's is {instead}" if instead else "")]
    lightning_hooks = {n for c in callback.__mro__ if is_lightning_code(c) for n in vars(c) if not n.startswith("_")}
    mine = {n for c in callback.__mro__ if not is_lightning_code(c) and c is not object for n in vars(c)}
    lines = []
    for hook in sorted(mine & lightning_hooks):
        if hook not in CALLBACK_HOOKS and (stage == "predict" or not hook.startswith("on_predict")):
            lines.append(f"{key} ({callback.__name__}) overrides {hook}, which the runner does not call")
        elif hook in NEEDS_STEPS and not lightning_model:
            lines.append(f"{key} ({callback.__name__}) overrides {hook}: the runner calls it around a "
                         "LightningModule's steps, and the model is not a LightningModule")
    return lines


def config_problems(cfg: Any, meta_model: Callable[[], Any], strategy: Optional[type]) -> Iterator[str]:
    """Every refusal for the config's model and callbacks; `meta_model` builds the model on the meta device,
    `strategy` is the strategy's class (None when unknown)."""
    from hydra.utils import get_method

    from runner.lightning.manual import manual_problems
    from runner.strategies import DataParallelStrategy

    stage = str(cfg.get("stage", "fit"))
    target = cfg.model.get("_target_") if hasattr(cfg.model, "get") else None
    cls = model_class(target) if isinstance(target, str) else None
    instance = _built(meta_model) if cls is not None or _may_be_lightning(target) else None
    if cls is None and instance is not None and is_lightning_module(instance):
        yield (f"model._target_={target} returns a LightningModule ({type(instance).__name__}) from a function; name "
               "the class itself, so that the runner knows before building it to run its steps")
    lightning = cls is not None
    if lightning:
        yield from module_problems(cls, stage)
        if instance is not None:
            yield from (line for line in module_problems(instance, stage) if line not in module_problems(cls, stage))
            if stage == "fit":
                yield from optimizer_problems(instance)
                yield from manual_problems(instance, cfg)
        if strategy is not None and issubclass(strategy, DataParallelStrategy):
            yield ("strategy=dp: a LightningModule runs under strategy=ddp (one process per device; Lightning 2 has no "
                   "DataParallel either)")
        if cfg.get("metrics"):
            yield (f"metrics={list(cfg.metrics)}: a LightningModule logs its own metrics (self.log in validation_step, "
                   "torchmetrics objects included); the metrics config is for the runner's tasks")
    callbacks = cfg.get("callbacks")
    for name, spec in callbacks.items() if hasattr(callbacks, "items") else ():
        callback_target = spec.get("_target_") if hasattr(spec, "get") else None
        try:
            found = get_method(callback_target) if isinstance(callback_target, str) else None
        except Exception:  # noqa: BLE001 - the static checks report a target that does not import
            continue
        if inspect.isclass(found) and is_lightning_callback(found):
            yield from callback_problems(f"callbacks.{name}", found, lightning, stage)


def _may_be_lightning(target: Any) -> bool:
    """A target that is a function may return a LightningModule: build it to know (classes are known by name)."""
    from hydra.utils import get_method

    try:
        return isinstance(target, str) and not inspect.isclass(get_method(target))
    except Exception:  # noqa: BLE001
        return False


def _built(meta_model: Callable[[], Any]) -> Optional[Any]:
    try:
        return meta_model()
    except Exception:  # noqa: BLE001 - a model that cannot be built on the meta device is checked in the workers
        return None
