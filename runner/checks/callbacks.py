"""What the loop calls around its steps: callbacks, metrics (and the task's top_k), loggers.

CLI → compose → [validate: these checks, after the data and schedule] → run folder → launch → worker → build →
loop → teardown. Each is built once here as the workers will build it (a logger in a scratch folder), so a
refused setting or a missing hook is one line before any worker starts.
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from typing import Any, Iterator

from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from runner.build import build_callbacks, build_metric, build_one_logger, guessed_modes, metric_specs, monitor_defaults
from runner.checks.signatures import check_settings, is_fsdp, parameters
from runner.config import ConfigError
from runner.plan import Plan
from runner.values import is_int, one_line, suggest


def check_top_k(plan: Plan) -> Iterator[str]:
    """top_k beyond the data's classes is known before any batch when the data names its class count."""
    cfg = plan.cfg
    top_k, classes = cfg.task.get("top_k"), cfg.data.get("num_classes") if OmegaConf.is_dict(cfg.data) else None
    if OmegaConf.is_list(top_k) and is_int(classes) and any(is_int(k) and k > classes for k in top_k):
        yield f"task.top_k={list(top_k)} asks for more than data.num_classes={classes} classes"


def check_metrics(plan: Plan) -> Iterator[str]:
    from runner.metrics import STAGES, is_metric

    cfg = plan.cfg
    node = cfg.get("metrics")
    if node is not None and not (OmegaConf.is_dict(node) or OmegaConf.is_list(node)):
        yield f"metrics={node} must map names to metrics, e.g. +metrics.f1._target_=<a metric class>"
        return
    try:
        specs = metric_specs(cfg)
    except ConfigError as error:
        yield from error.problems
        return
    for name, (spec, stages) in specs.items():
        if "/" in name or not name:
            yield f"metrics.{name}: a metric's name must not be empty or contain '/' (it is logged as val/<name>)"
        if not set(stages) <= set(STAGES) or not stages:
            yield f"metrics.{name}._stages_={list(stages)} is not allowed: use a list of {', '.join(STAGES)}"
        if "_target_" not in spec:
            yield f"metrics.{name} has no _target_: name a metric class, e.g. runner.metrics.Accuracy"
            continue
        target = get_method(spec._target_)
        if not is_metric(target):
            yield (f"metrics.{name}._target_={spec._target_} is not a metric: a metric has update(preds, target), "
                   "compute() and reset() (e.g. torchmetrics.classification.MulticlassF1Score, runner.metrics.F1Score)")
            continue
        try:  # built, not bound: torchmetrics takes **kwargs and checks them itself
            build_metric(spec)
        except Exception as error:  # noqa: BLE001
            yield (f"metrics.{name} ({spec._target_}) does not accept its settings: {one_line(error)}"
                   f"{_unknown_settings(f'metrics.{name}', spec, target)}")


def _unknown_settings(key: str, spec: DictConfig, target: Any) -> str:
    """Keys that only a **kwargs took, which is where a misspelt one goes: `num_class` for `num_classes`."""
    named = [n for n, p in (parameters(target) or {}).items()
             if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) and n != "self"]
    unknown = [str(k) for k in spec if not str(k).startswith("_") and str(k) not in named]
    return "".join(f"; {key}.{k} is not one of its parameters{suggest(k, named)}" for k in unknown) if named else ""


def check_callbacks(plan: Plan) -> Iterator[str]:
    from runner.callbacks import EMA, HOOKS

    cfg = plan.cfg
    node = cfg.get("callbacks")
    if OmegaConf.is_dict(node):  # each callback's keys against its class, naming the allowed ones
        keyed = [p for name, spec in node.items() if OmegaConf.is_dict(spec) and "_target_" in spec
                 for p in check_settings(f"callbacks.{name}", OmegaConf.merge(spec, monitor_defaults(cfg, spec)))]
        keyed += guessed_modes(cfg)
        if keyed:
            yield from keyed
            return
    try:
        callbacks = build_callbacks(cfg)
    except ConfigError as error:
        yield from error.problems
        return
    except Exception as error:  # noqa: BLE001 - a refused setting is the user's to fix
        yield f"callbacks: {one_line(error)}"
        return
    for name, callback in callbacks.by_name.items():
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            yield (f"callbacks.{name} ({type(callback).__name__}) has none of the hooks {', '.join(HOOKS)}: "
                   "it would never be called")
        if isinstance(callback, EMA) and is_fsdp(cfg):  # the average of whole weights; FSDP holds shards
            yield EMA.SHARDED.format(name=name)


def check_loggers(plan: Plan) -> Iterator[str]:
    """Each logger has the four methods of a logger and is built once in a scratch folder (it may create files)."""
    from runner.loggers import LOGGER_METHODS

    for name, spec in plan.loggers.items():
        target = get_method(spec._target_)
        missing = [m for m in LOGGER_METHODS if not callable(getattr(target, m, None))]
        if missing:
            yield (f"logger.{name}._target_={spec._target_} is not a logger (it lacks {', '.join(missing)}): a logger "
                   "has log_metrics(metrics, step), resume_at(step), log_hyperparams(params, metrics) and finalize()")
            continue
        with tempfile.TemporaryDirectory() as scratch:
            try:
                logger = build_one_logger(spec, Path(scratch))
                logger.finalize()
            except Exception as error:  # noqa: BLE001 - any refusal of the settings is the user's to fix
                if isinstance(error.__cause__ or error, ImportError):  # an optional package: mlflow, wandb
                    yield f"logger.{name} ({spec._target_}): {error.__cause__ or error}"
                else:
                    yield f"logger.{name} ({spec._target_}) does not accept its settings: {one_line(error)}"
                continue
        # A logger that talks to a service says here whether it answers (a tracking server that is down).
        yield from (f"logger.{name}: {problem}" for problem in getattr(logger, "check_service", list)())
