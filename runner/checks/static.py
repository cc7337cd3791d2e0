"""Plain values in range and of their type (trainer, data's loader keys, stage, logger, objective), and every
`_target_` importable.

CLI → compose → [validate: these checks, after the keys] → run folder → launch → worker → build → loop →
teardown. No hardware and nothing built: what the later checks need before they build objects.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from runner.config import import_target, targets
from runner.values import is_int

# torch.manual_seed and the samplers' generators take seeds up to 2**64 - 1; each epoch adds one.
_SEED_LIMIT = 2**63 - 1


def check_trainer(t: DictConfig) -> Iterator[str]:
    devices = t.devices
    if isinstance(devices, str) and devices != "auto" and devices.strip().lstrip("-").isdigit():
        yield (f"trainer.devices='{devices}' is a string, not a number (quoted on the command line or in YAML): "
               f"write trainer.devices={devices.strip()}")
    elif not (devices == "auto" or (is_int(devices) and (devices >= 1 or devices == -1)) or _is_index_list(devices)):
        yield (f"trainer.devices={devices} is not allowed: use a positive number of devices, -1 or 'auto' "
               "(all devices), or a list of device indices such as [0,1]")
    positive = ("num_nodes", "accumulate_grad_batches", "log_every_n_steps")
    for key in positive:
        if not (is_int(t[key]) and t[key] >= 1):
            yield f"trainer.{key}={t[key]} must be a positive integer"
    for key in ("max_epochs", "max_steps"):
        if not (is_int(t[key]) and (t[key] >= 1 or t[key] == -1)) and not (key == "max_epochs" and t[key] is None):
            yield f"trainer.{key}={t[key]} must be a positive integer, or -1 for no limit"
    if t.max_epochs == -1 and t.max_steps == -1 and not t.fast_dev_run:
        yield "trainer.max_epochs=-1 and trainer.max_steps=-1 would train forever: set one of them"
    if not (is_int(t.max_restarts) and t.max_restarts >= 0):
        yield f"trainer.max_restarts={t.max_restarts} must be 0 (no restarts) or a positive integer"
    if t.gradient_clip_val is not None and not 0 < t.gradient_clip_val < math.inf:  # NaN fails both
        yield f"trainer.gradient_clip_val={t.gradient_clip_val} must be a positive number, or null for no clipping"
    if t.keep_last_k is not None and t.keep_last_k < 1:
        yield (f"trainer.keep_last_k={t.keep_last_k} must be a positive integer, or null to keep every periodic "
               "checkpoint (step-000020.ckpt: the step in 6 digits)")
    if t.ckpt_every_n_steps is not None and t.ckpt_every_n_steps < 1:
        yield f"trainer.ckpt_every_n_steps={t.ckpt_every_n_steps} must be a positive integer, or null"
    for key in ("val_check_interval", "limit_train_batches", "limit_val_batches", "limit_test_batches",
                "limit_predict_batches"):
        yield from _check_fraction_or_count(key, t.get(key, 1.0), allow_zero=key == "limit_val_batches")
    if not (isinstance(t.fast_dev_run, bool) or (is_int(t.fast_dev_run) and t.fast_dev_run >= 0)):
        yield f"trainer.fast_dev_run={t.fast_dev_run} must be true, false or a number of batches"
    if not (is_int(t.seed) and 0 <= t.seed <= _SEED_LIMIT):
        yield f"trainer.seed={t.seed} must be an integer from 0 to 2**63-1"
    if t.get("peak_tflops") is not None and not 0 < t.peak_tflops < math.inf:
        yield f"trainer.peak_tflops={t.peak_tflops} must be a positive number (one device's TFLOP/s), or null"
    bar = t.get("progress_bar", "auto")
    if not (isinstance(bar, bool) or bar == "auto"):  # not `in (True, False)`: 1 == True would pass
        yield f"trainer.progress_bar={t.progress_bar} is not allowed: use auto (a bar on a terminal), true or false"
    threads = t.get("num_threads", "auto")
    if not (threads == "auto" or (is_int(threads) and threads >= 1)):
        yield (f"trainer.num_threads={threads} is not allowed: use auto (OMP_NUM_THREADS when set, else the CPUs this "
               "process may use divided over the processes on its node) or a positive number of threads per process")
    if t.get("data_resume", "exact") not in ("exact", "restart"):
        yield (f"trainer.data_resume={t.data_resume} is not allowed: use exact (continue the data where the "
               "checkpoint stopped) or restart (its epoch from the first batch)")
    resume = t.get("resume", "exact")
    if resume not in ("exact", "new_schedule", "weights"):
        yield (f"trainer.resume={resume} is not allowed: use exact (continue the checkpoint's schedule), "
               "new_schedule (the configured scheduler from its step over the steps left) or weights (its weights "
               "only, from step 0)")
    elif resume != "exact" and not t.ckpt_path:
        yield f"trainer.resume={resume} takes a checkpoint: set trainer.ckpt_path=<file>"
    if not (isinstance(t.compile, bool) or OmegaConf.is_dict(t.compile)):
        yield (f"trainer.compile={t.compile} must be true, false, or torch.compile's keyword arguments, "
               "e.g. trainer.compile={mode:max-autotune}")


def _is_index_list(value: Any) -> bool:
    items = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
    return isinstance(items, (list, tuple)) and len(items) > 0 and all(is_int(i) and i >= 0 for i in items)


def _check_fraction_or_count(key: str, value: Any, allow_zero: bool) -> Iterator[str]:
    low = 0 if allow_zero else 1
    if is_int(value) and value >= low:
        return
    if isinstance(value, float) and (0.0 < value <= 1.0 or (allow_zero and value == 0.0)):
        return
    yield (f"trainer.{key}={value} is not allowed: use a fraction of an epoch in (0, 1] "
           f"or a whole number of batches >= {low}")


def check_targets(cfg: DictConfig) -> Iterator[str]:
    for key, target in targets(cfg):
        try:
            import_target(target)
        except (ImportError, AttributeError, ValueError) as err:
            yield f"{key}={target} cannot be imported ({type(err).__name__}: {err}); check the module and name"


def check_data(cfg: DictConfig) -> Iterator[str]:
    """The keys the runner's loaders read from any data object: batch_size, num_workers, pin_memory; and seed."""
    data = cfg.data
    batch_size = data.get("batch_size")
    if batch_size is not None and not (is_int(batch_size) and batch_size >= 1):
        yield f"data.batch_size={batch_size} must be a positive integer (samples per process)"
    workers = data.get("num_workers")
    if workers is not None and not (is_int(workers) and workers >= 0):
        yield f"data.num_workers={workers} must be 0 (load in the training process) or a positive number of processes"
    pin = data.get("pin_memory")
    if pin is not None and not isinstance(pin, bool):
        yield f"data.pin_memory={pin} must be true or false"
    seed = data.get("seed")
    if seed is not None and not (is_int(seed) and 0 <= seed <= _SEED_LIMIT):
        yield f"data.seed={seed} must be an integer from 0 to 2**63-1"


def check_stage(cfg: DictConfig) -> Iterator[str]:
    stage = cfg.get("stage", "fit")
    if stage not in ("fit", "validate", "test", "predict", "check", "check_data"):
        yield (f"stage={stage} is not allowed: use fit, validate, test, predict, check (the config checked, nothing "
               "run) or check_data (the same, with the data module's prepare_data and setup)")
    elif stage in ("validate", "test", "predict") and not cfg.trainer.ckpt_path:
        yield (f"stage={stage} needs the weights to use: trainer.ckpt_path=<file>, last or best "
               "(the newest of this run folder, else of a run of the same config)")


_CHOOSE_LOGGER = "choose logger=tensorboard, logger=csv, logger=none (no logger) or several: logger=[tensorboard,csv]"


def check_logger(cfg: DictConfig) -> Iterator[str]:
    node = cfg.get("logger")
    if node is None:
        yield f"logger is not set (logger=null and ~logger remove it): {_CHOOSE_LOGGER}"
        return
    if not OmegaConf.is_dict(node):
        yield f"logger={node} must map names to loggers: {_CHOOSE_LOGGER}"
        return
    for name in node:
        value = node[name]
        if name == "_target_":
            yield (f"logger._target_={value}: each logger sits under a name of its own, e.g. "
                   f"+logger.mine._target_={value} (logger=[tensorboard,csv] chooses several)")
        elif not (OmegaConf.is_dict(value) and "_target_" in value):
            yield f"logger.{name}={value} has no _target_: name a logger class, e.g. runner.loggers.CSVLogger"


def check_objective(cfg: DictConfig) -> Iterator[str]:
    if cfg.get("direction") not in ("minimize", "maximize"):
        yield (f"direction={cfg.get('direction')} is not allowed: use minimize or maximize "
               f"(for objective={cfg.get('objective')})")
    if not (isinstance(cfg.get("objective"), str) and cfg.objective):
        yield f"objective={cfg.get('objective')} must name a metric, e.g. val/loss or val/acc"

