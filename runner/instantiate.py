"""The one place a composed config becomes objects (the only caller of hydra.utils.instantiate)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from runner.config import ConfigError, _is_int, check_static
from runner.signatures import check_settings


def build_accelerator(cfg: DictConfig) -> Any:
    return instantiate(cfg.accelerator)


def build_precision(cfg: DictConfig, accelerator: Any) -> Any:
    # `device: auto` in the mixed-precision options follows the accelerator (autocast needs its device type).
    if cfg.precision.get("device") == "auto":
        return instantiate(cfg.precision, device=accelerator.device_type)
    return instantiate(cfg.precision)


def devices_setting(cfg: DictConfig, environment: Any) -> Any:
    """`trainer.devices`, where `auto` under torchrun or srun means the processes they started per node."""
    if cfg.trainer.devices == "auto" and environment.creates_processes_externally:
        return max(1, environment.world_size() // cfg.trainer.num_nodes)
    return cfg.trainer.devices


def build_strategy(cfg: DictConfig) -> Any:
    """accelerator -> precision -> checkpoint IO -> cluster environment -> strategy, as its constructor arguments."""
    accelerator = build_accelerator(cfg)
    environment = instantiate(cfg.cluster)
    devices = accelerator.get_parallel_devices(devices_setting(cfg, environment))
    precision = build_precision(cfg, accelerator)
    offers = {
        "accelerator": accelerator,
        "parallel_devices": devices,
        "device": devices[0],
        "cluster_environment": environment,
        "checkpoint_io": instantiate(cfg.checkpoint_io),
        "precision": precision,
        "precision_plugin": precision,
    }
    # Each strategy takes the components its constructor names (DP calls precision `precision_plugin`).
    accepted = inspect.signature(get_method(cfg.strategy._target_)).parameters
    return instantiate(cfg.strategy, **{k: v for k, v in offers.items() if k in accepted})


# What build_strategy offers a strategy itself (the keys of its `offers`): not settings of the `strategy` group.
STRATEGY_COMPONENTS = ("accelerator", "parallel_devices", "device", "cluster_environment", "checkpoint_io",
                       "precision", "precision_plugin")


def build_model(cfg: DictConfig) -> Any:
    return instantiate(cfg.model)


def build_data(cfg: DictConfig) -> Any:
    """The data, after checking on the meta device that the model and task take its batches.

    Here, where each process builds its data anyway: checking in the parent would build the data twice.
    A model that does not fit (an input width other than the data's) fails with the sizes of both.
    """
    data = instantiate(cfg.data)
    problem = _data_contract(cfg, data) or model_data_mismatch(cfg, data)
    if problem:
        raise ConfigError([problem])
    return data


def _data_contract(cfg: DictConfig, data: Any) -> Optional[str]:
    """What the data object lacks of what the loop reads from it (README, "Your own model and data")."""
    what = f"data ({cfg.data._target_})"
    batch_size = getattr(data, "batch_size", None)
    if not (isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0):
        return (f"{what} has batch_size={batch_size!r}: a data object needs a positive integer batch_size (per "
                "process) beside train_dataset")
    for name in ("train_dataset", "val_dataset", "test_dataset", "predict_dataset"):
        dataset = getattr(data, name, None)
        if dataset is None and name != "train_dataset":
            continue
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            return (f"{what}.{name} is {type(dataset).__name__}, not a map-style dataset (len() and indexing): "
                    "each process takes its own samples of it by index, so every sample is seen once")
    return None


def build_task(cfg: DictConfig) -> Any:
    return instantiate(cfg.task)


# Integer settings that are not sizes of a tensor, left out of a size mismatch's message.
_NOT_SIZES = ("seed", "num_workers", "num_samples", "val_samples", "batch_size")


def model_data_mismatch(cfg: DictConfig, data: Any) -> Optional[str]:
    """What goes wrong when two samples of the data pass through the model and task on the meta device.

    Shapes only: no memory, no initialisation, and the random number generators are left as they were.
    None when they fit, or when the model or its operations cannot run on the meta device (the worker then
    reports its own errors).
    """
    from runner.data import collate
    from runner.precision import Precision
    from runner.tasks import BatchError, TaskModule
    from runner.tree import apply_to_tensors

    with torch.random.fork_rng(devices=[]), _python_rng_kept():
        try:
            dataset = data.train_dataset
            samples = [dataset[i] for i in range(min(2, len(dataset)))]
            batch = apply_to_tensors(getattr(data, "collate_fn", collate)(samples), lambda t: t.to("meta"))
            with torch.device("meta"):
                model = build_model(cfg)
            module = TaskModule(model, build_task(cfg), Precision())
        except Exception:  # noqa: BLE001 - built for real by the worker, which reports its own errors
            return None
        if not samples:
            return None
        try:
            with torch.no_grad():
                module(batch)
        except TypeError as error:
            if not re.search(r"forward\(\) (got an unexpected keyword|missing \d+ required)|must be Tensor, not ",
                             str(error)):
                return None
            keys = (f" with the keys {', '.join(map(str, batch))}" if isinstance(batch, dict)
                    else f" (each a {type(batch).__name__}, which task=model passes to the model whole)"
                    if not module.task.takes_pairs else "")
            return (f"model ({cfg.model._target_}) cannot be called on the batches of data ({cfg.data._target_})"
                    f"{keys}: {_one_line(error)}")
        except (RuntimeError, ValueError, IndexError, BatchError) as error:
            if "meta" in str(error).lower():  # an operation the meta device cannot run: not a size problem
                return None
            return (f"model ({cfg.model._target_}) does not take the batches of data ({cfg.data._target_}): "
                    f"{_one_line(error)}; sizes: {_sizes('model', cfg.model)}; {_sizes('data', cfg.data)}")
        except Exception:  # noqa: BLE001
            return None
    return None


def _sizes(group: str, node: DictConfig) -> str:
    values = OmegaConf.to_container(node, resolve=True)
    return ", ".join(f"{group}.{k}={v}" for k, v in values.items()
                     if _is_int(v) and k not in _NOT_SIZES) or f"{group}: no integer settings"


@contextlib.contextmanager
def _quiet_runner_log() -> Iterator[None]:
    """A trial build's log lines are not the run's."""
    runner_log = logging.getLogger("runner")
    disabled, runner_log.disabled = runner_log.disabled, True
    try:
        yield
    finally:
        runner_log.disabled = disabled


@contextlib.contextmanager
def _python_rng_kept() -> Iterator[None]:
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def metric_specs(cfg: DictConfig) -> dict[str, tuple[DictConfig, tuple[str, ...]]]:
    """`metrics` as {name: (spec without `_stages_`, stages)}; a list takes names from the classes."""
    from runner.metrics import default_name

    node = cfg.get("metrics")
    if node is None:
        return {}
    items = node.items() if OmegaConf.is_dict(node) else ((default_name(str(m.get("_target_"))), m) for m in node)
    specs = {}
    for name, spec in items:
        spec = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec
        if not isinstance(spec, dict):
            raise ConfigError([f"metrics.{name}={spec} must be a metric's settings with a _target_"])
        stages = spec.pop("_stages_", ["val"])
        stages = [stages] if isinstance(stages, str) else list(stages)
        if name in specs:
            raise ConfigError([f"metrics: two metrics are named {name!r}; give them names (a dict, name -> metric)"])
        specs[str(name)] = (OmegaConf.create(spec), tuple(stages))
    return specs


def _monitor_defaults(cfg: DictConfig, spec: DictConfig) -> dict:
    """An unset `monitor`/`mode` of a callback follows the run's `objective`/`direction`."""
    defaults = {"monitor": cfg.get("objective", "val/loss"),
                "mode": "max" if cfg.get("direction") == "maximize" else "min"}
    return {key: value for key, value in defaults.items() if key in spec and spec[key] is None}


def _guessed_modes(cfg: DictConfig) -> Iterator[str]:
    """A callback monitoring another metric than the objective cannot take `direction` as its mode: say which."""
    node = cfg.get("callbacks")
    objective = cfg.get("objective", "val/loss")
    for name, spec in node.items() if OmegaConf.is_dict(node) else ():
        if (OmegaConf.is_dict(spec) and "mode" in spec and spec.get("mode") is None
                and spec.get("monitor") not in (None, objective)):
            yield (f"callbacks.{name}.monitor={spec.monitor} is not the objective ({objective}), so "
                   f"direction={cfg.get('direction', 'minimize')} says nothing about it: set "
                   f"callbacks.{name}.mode=max (larger is better) or mode=min")


def build_callbacks(cfg: DictConfig) -> Any:
    """The `callbacks` group's options by name; an unset `monitor`/`mode` follows `objective`/`direction`."""
    from runner.callbacks import Callbacks, ObjectiveCheck

    checks = {"objective check": ObjectiveCheck(str(cfg.objective))} if cfg.get("objective") else {}
    node = cfg.get("callbacks")
    if node is None:
        return Callbacks(checks)
    if not OmegaConf.is_dict(node):
        raise ConfigError([f"callbacks={node} must select options of the callbacks group, e.g. "
                           "callbacks=[early_stopping,model_checkpoint], or callbacks=none"])
    built = dict(checks)
    for name, spec in node.items():
        if not OmegaConf.is_dict(spec) or "_target_" not in spec:
            raise ConfigError([f"callbacks.{name} must be a callback with a _target_ (an option of the callbacks "
                               "group, or +callbacks.<name>._target_=<class>)"])
        built[str(name)] = instantiate(spec, **_monitor_defaults(cfg, spec))
    problems = list(_guessed_modes(cfg))
    if problems:
        raise ConfigError(problems)
    return Callbacks(built)


def build_metrics(cfg: DictConfig, strategy: Any) -> Any:
    from runner.metrics import MetricSet

    return MetricSet({name: (instantiate(spec), stages) for name, (spec, stages) in metric_specs(cfg).items()},
                     strategy)


def build_optimizer(cfg: DictConfig, parameters: Any) -> Any:
    """The optimizer over `parameters` (already on their device); AdamW, Adam and SGD run fused on CUDA."""
    parameters = list(parameters)
    extra = fused_setting(cfg.optimizer, {t.device.type for t in _tensors(parameters)})
    if extra:
        logging.getLogger("runner").info("optimizer: fused=True (every parameter is on CUDA); +optimizer.foreach=true "
                                         "runs torch's own default, the multi-tensor update, instead")
    try:
        return instantiate(cfg.optimizer)(parameters, **extra)
    except (TypeError, ValueError) as error:  # e.g. lr=-1: a config problem, not a bug
        raise ConfigError([f"optimizer ({cfg.optimizer._target_}) does not accept its settings: "
                           f"{_one_line(error)}"]) from error


# Optimizers whose single fused kernel per step torch offers on CUDA (its default there is the multi-kernel foreach).
FUSED_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


def fused_setting(node: DictConfig, device_types: set[str]) -> dict:
    """{"fused": True} for AdamW, Adam and SGD (and their subclasses) when every parameter is on CUDA and the
    config chose neither `fused` nor `foreach` (nor `differentiable`, which fused refuses); else {}."""
    target = get_method(node._target_)
    fusable = inspect.isclass(target) and issubclass(target, FUSED_OPTIMIZERS) and _accepts(target, "fused")
    chosen = any(node.get(key) is not None for key in ("fused", "foreach")) or bool(node.get("differentiable"))
    return {"fused": True} if fusable and not chosen and device_types == {"cuda"} else {}


def _tensors(parameters: list) -> Iterator[torch.Tensor]:
    """The tensors of a parameter list: tensors, (name, tensor) pairs, or groups {"params": [...]}."""
    for item in parameters:
        if isinstance(item, dict):
            yield from _tensors(list(item.get("params", [])))
        elif isinstance(item, tuple):
            yield item[-1]
        else:
            yield item


def build_scheduler(cfg: DictConfig, optimizer: Any, total_steps: Optional[int] = None) -> Any:
    """The scheduler for `optimizer`; one that takes `total_steps` and leaves it unset gets the run's count."""
    try:
        return instantiate(cfg.scheduler)(optimizer, **_scheduler_extra(cfg, total_steps))
    except (TypeError, ValueError) as error:
        raise ConfigError([f"scheduler ({cfg.scheduler._target_}) does not accept its settings: "
                           f"{_one_line(error)}"]) from error


def _scheduler_extra(cfg: DictConfig, total_steps: Optional[int]) -> dict:
    """`total_steps` for a scheduler that takes it and whose config leaves it out."""
    takes_total = "total_steps" in inspect.signature(get_method(cfg.scheduler._target_)).parameters
    return {"total_steps": total_steps} if takes_total and "total_steps" not in cfg.scheduler else {}


def compile_arguments(cfg: DictConfig) -> Optional[dict]:
    """`trainer.compile`: None (off), or the keyword arguments for torch.compile (true: its defaults)."""
    setting = cfg.trainer.get("compile", False)
    if setting is True:
        return {}
    return OmegaConf.to_container(setting, resolve=True) if OmegaConf.is_dict(setting) and setting else None


def logger_specs(cfg: DictConfig) -> dict[str, DictConfig]:
    """`logger` as {name: settings}: one entry per chosen option (`logger=[tensorboard,csv]`), none for `none`."""
    node = cfg.get("logger")
    return {str(name): node[name] for name in node} if OmegaConf.is_dict(node) else {}


def build_logger(cfg: DictConfig, run_dir: Path, enabled: bool) -> Any:
    """Rank 0 gets the configured loggers (several as one LoggerSet); the other ranks a logger that does nothing."""
    from runner.loggers import LoggerSet, NullLogger

    loggers = [_build_one_logger(spec, run_dir) for spec in logger_specs(cfg).values()] if enabled else []
    if not loggers:
        return NullLogger()
    return loggers[0] if len(loggers) == 1 else LoggerSet(loggers)


def _build_one_logger(spec: DictConfig, run_dir: Path) -> Any:
    # A logger gets the run folder as `root_dir` when its constructor takes one (and its settings do not set it).
    if "root_dir" not in spec and _accepts(get_method(spec._target_), "root_dir"):
        return instantiate(spec, root_dir=str(run_dir))
    return instantiate(spec)


def _accepts(target: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _strategy_class(cfg: DictConfig) -> Any:
    """The class `strategy._target_` names, or None when it names a factory function."""
    target = get_method(cfg.strategy._target_)
    return target if inspect.isclass(target) else None


# -- checks that need the hardware or the cluster ----------------------------------------------------

def _check_components(cfg: DictConfig) -> Iterator[str]:
    from runner.strategies import DataParallelStrategy, SingleDeviceStrategy

    accelerator = build_accelerator(cfg)
    kind = accelerator.device_type
    if not accelerator.is_available():
        yield (f"accelerator={kind} but no {kind.upper()} device is available here; "
               "use accelerator=cpu or accelerator=auto")
        return
    environment = instantiate(cfg.cluster)
    indices = accelerator.parse_devices(devices_setting(cfg, environment))
    available = accelerator.auto_device_count()
    if kind != "cpu" and (not indices or max(indices) >= available):
        yield f"trainer.devices={cfg.trainer.devices} but only {available} {kind.upper()} device(s) are visible"
        return
    strategy_class = _strategy_class(cfg)
    if strategy_class and issubclass(strategy_class, SingleDeviceStrategy) and len(indices) > 1:
        yield (f"trainer.devices={cfg.trainer.devices} needs strategy=ddp or strategy=dp "
               "(strategy=single runs on one device)")
    if strategy_class and issubclass(strategy_class, DataParallelStrategy) and kind == "cpu" and len(indices) > 1:
        yield (f"trainer.devices={cfg.trainer.devices} needs accelerator=cuda for strategy=dp "
               "(DataParallel splits batches over CUDA devices; use strategy=ddp on CPU)")
    if cfg.precision.get("precision") == "16-mixed" and kind == "cpu":
        yield ("precision=16-mixed needs accelerator=cuda (float16 autocast with loss scaling is for GPUs); "
               "on CPU use precision=bf16-mixed")
    start_method = cfg.strategy.get("start_method")
    if start_method is not None and start_method not in ("popen", "spawn", "fork"):
        yield f"strategy.start_method={start_method} is not allowed: use popen, spawn or fork"
    timeout = cfg.strategy.get("timeout")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        yield f"strategy.timeout={timeout} must be a positive number of seconds"
    yield from environment.validate_settings(len(indices), cfg.trainer.num_nodes)


def _check_backend(cfg: DictConfig) -> Iterator[str]:
    """strategy.process_group_backend against the accelerator: a backend its devices lack (nccl on CPU) or a
    misspelt one fails only in the workers, every rank with its own traceback."""
    from runner.signatures import suggest

    backend = cfg.strategy.get("process_group_backend")
    if backend is None or not torch.distributed.is_available():
        return
    accelerator = build_accelerator(cfg)
    kind = accelerator.device_type
    if not accelerator.is_available():
        return  # _check_components says so
    capability = {name: devices for name, devices in torch.distributed.Backend.backend_capability.items()
                  if name not in ("fake", "undefined")}  # torch's own test stand-in, and the unset marker
    allowed = [name for name, devices in capability.items()
               if kind in devices and torch.distributed.is_backend_available(name)]
    # torch also takes one backend per device type: "cpu:gloo,cuda:nccl".
    pairs = dict(part.split(":", 1) if ":" in part else (kind, part) for part in str(backend).lower().split(","))
    name = pairs.get(kind)
    allowed_text = f"allowed with accelerator={kind}: {', '.join(allowed)}, or null (the device's default)"
    if name is None:
        reason = f"names no backend for {kind}"
    elif name not in capability:
        reason = f"is not a process group backend{suggest(name, list(capability))}"
    elif kind not in capability[name]:
        reason = f"does not run on {kind} ({name} runs on {', '.join(capability[name])})"
    elif name not in allowed:
        reason = "is not available in this build of torch"
    else:
        return
    yield f"strategy.process_group_backend={backend} {reason}; {allowed_text}"


def _check_trainable(cfg: DictConfig) -> Iterator[str]:
    """A model without a parameter to train (built on the meta device: shapes only, in milliseconds)."""
    if cfg.get("stage", "fit") != "fit":
        return  # validating, testing or predicting with a frozen model is fine
    try:
        with torch.random.fork_rng(devices=[]), _python_rng_kept(), torch.device("meta"):
            model = build_model(cfg)
    except Exception:  # noqa: BLE001 - a model the meta device cannot build is checked in the workers
        return
    if not isinstance(model, torch.nn.Module):
        return
    parameters = list(model.parameters())
    if not parameters:
        yield (f"model ({cfg.model._target_}) has no parameters: the optimizer would get an empty list and "
               "nothing would train (stage=validate, test or predict run a model without training it)")
    elif not any(p.requires_grad for p in parameters):
        yield (f"model ({cfg.model._target_}) has no trainable parameters: all {len(parameters)} have "
               "requires_grad=False, so the optimizer would change nothing; leave some trainable")


def _check_half_optimizer(cfg: DictConfig) -> Iterator[str]:
    """float16 rounds an epsilon below ~3e-8 to 0; Adam-style updates then divide by zero and the loss turns NaN."""
    optimizer = cfg.get("optimizer")
    if cfg.precision.get("precision") != "16-true" or not OmegaConf.is_dict(optimizer) or "_target_" not in optimizer:
        return
    eps = optimizer.get("eps")
    if eps is None:
        default = inspect.signature(get_method(optimizer._target_)).parameters.get("eps")
        eps = default.default if default is not None else None
    if isinstance(eps, (int, float)) and eps > 0 and torch.tensor(eps, dtype=torch.float16).item() == 0:
        key = "optimizer.eps" if "eps" in optimizer else "+optimizer.eps"
        yield (f"precision=16-true with optimizer eps={eps}: float16 rounds it to 0, so the first updates "
               f"overflow; set {key}=1e-4, or use precision=bf16-true or bf16-mixed")


def _one_line(error: BaseException) -> str:
    """`Type: message` on one line; for a failed instantiate, of what the target itself raised."""
    if isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    return " ".join(f"{type(error).__name__}: {error}".split())


def _check_compile(cfg: DictConfig) -> Iterator[str]:
    from runner.strategies import DataParallelStrategy

    arguments = compile_arguments(cfg)
    if arguments is None:
        return
    try:
        inspect.signature(torch.compile).bind(None, **arguments)
    except TypeError as error:
        allowed = ", ".join(p for p in inspect.signature(torch.compile).parameters if p != "model")
        yield f"trainer.compile={arguments}: {error} (torch.compile takes {allowed})"
    strategy_class = _strategy_class(cfg)
    if strategy_class and issubclass(strategy_class, DataParallelStrategy):
        yield ("trainer.compile needs strategy=single or strategy=ddp: DataParallel copies the module to every "
               "device at every step, and the copies would run the original's compiled code")


def _check_signatures(cfg: DictConfig) -> Iterator[str]:
    """Every group's keys against its target's constructor: `+strategy.timeot=5` fails here, by name."""
    from torch.nn.parallel import DistributedDataParallel

    from runner.strategies import DDPStrategy

    strategy_class = _strategy_class(cfg)
    ddp = DistributedDataParallel if strategy_class and issubclass(strategy_class, DDPStrategy) else None
    # DDPStrategy passes its other keyword arguments to DistributedDataParallel; the module, the devices and
    # the process group are the strategy's own.
    yield from check_settings("strategy", _without_ddp_settings(cfg), injected=STRATEGY_COMPONENTS,
                              kwargs_target=ddp,
                              kwargs_skip=("module", "device_ids", "output_device", "process_group", "device_mesh"))
    yield from _ddp_settings_under_fsdp(cfg)
    for group in ("accelerator", "precision", "checkpoint_io", "cluster", "model", "data", "task"):
        yield from check_settings(group, cfg[group])
    yield from check_settings("optimizer", cfg.optimizer, leading=1)  # called with the model's parameters
    yield from check_settings("scheduler", cfg.scheduler, leading=1)  # called with the optimizer
    for name, spec in logger_specs(cfg).items():
        yield from check_settings(f"logger.{name}", spec)


def _is_fsdp(cfg: DictConfig) -> bool:
    from runner.strategies import FSDPStrategy

    strategy_class = _strategy_class(cfg)
    return bool(strategy_class and issubclass(strategy_class, FSDPStrategy))


def _ddp_only_keys(cfg: DictConfig) -> list[str]:
    """Keys of strategy=fsdp that are DistributedDataParallel's arguments (what strategy=ddp passes on)."""
    from torch.nn.parallel import DistributedDataParallel

    from runner.signatures import parameters

    if not _is_fsdp(cfg):
        return []
    own = parameters(get_method(cfg.strategy._target_)) or {}
    ddp = parameters(DistributedDataParallel) or {}
    return [str(k) for k in cfg.strategy if k not in own and k in ddp]


def _without_ddp_settings(cfg: DictConfig) -> DictConfig:
    keys = _ddp_only_keys(cfg)
    if not keys:
        return cfg.strategy
    node = OmegaConf.to_container(cfg.strategy, resolve=True)
    return OmegaConf.create({k: v for k, v in node.items() if k not in keys})


def _ddp_settings_under_fsdp(cfg: DictConfig) -> Iterator[str]:
    from runner.signatures import parameters

    own = [p for p in (parameters(get_method(cfg.strategy._target_)) or {}) if p not in STRATEGY_COMPONENTS]
    for key in _ddp_only_keys(cfg):
        yield (f"strategy.{key}={cfg.strategy[key]} is a setting of DistributedDataParallel (strategy=ddp); "
               f"strategy=fsdp shards instead of replicating and takes: {', '.join(own)}")


def _check_fsdp(cfg: DictConfig) -> Iterator[str]:
    """strategy=fsdp's settings, and the class names it names against the model (built on the meta device)."""
    from runner.strategies import fsdp

    if not _is_fsdp(cfg):
        return
    node = cfg.strategy
    shard = node.get("shard", "auto")
    shard = shard if shard == "auto" else fsdp.as_names(shard)
    checkpointing = fsdp.as_names(node.get("activation_checkpointing") or [])
    precision = OmegaConf.create({"precision": cfg.precision.get("precision")})
    problems = fsdp.settings_problems(shard, checkpointing, node.get("state_dict_type", "sharded"), precision)
    yield from problems
    if problems:
        return
    try:
        with torch.random.fork_rng(devices=[]), _python_rng_kept(), torch.device("meta"):
            model = build_model(cfg)
    except Exception:  # noqa: BLE001 - a model the meta device cannot build is checked in the workers
        return
    for key, names in (("shard", [] if shard == "auto" else shard), ("activation_checkpointing", checkpointing)):
        missing = sorted(set(names) - set(fsdp.module_classes(model)))
        if missing:
            yield fsdp.unknown_classes_message(key, missing, model)


# What a constructor raises for values it refuses (ZeroDivisionError: StepLR's step_size=0 at its first step).
_REFUSALS = (TypeError, ValueError, RuntimeError, KeyError, IndexError, ZeroDivisionError, OverflowError)


def probe_optimizer(node: DictConfig, parameters: list) -> Any:
    """The optimizer `node` configures, over `parameters`, without importing torch._dynamo; None if not a class.

    Optimizer.add_param_group is wrapped by torch._disable_dynamo, which imports torch._dynamo (~1 s) at its
    first call. A subclass calling the function underneath runs the same constructor checks (lr=-1 fails)
    and fills param_groups with every default, in milliseconds.
    """
    target = get_method(node._target_)
    if not (inspect.isclass(target) and issubclass(target, torch.optim.Optimizer)):
        return None
    plain = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if plain is not None:
        target = type(target.__name__, (target,), {"add_param_group": lambda self, group: plain(self, group)})
    settings = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not str(k).startswith("_")}
    return target(parameters, **settings)


# A schedule over more planned steps is probed over its first ones only: a scheduler step costs microseconds.
_PROBED_STEPS = 200_000


def _check_optimizer_and_scheduler(cfg: DictConfig, planned: Optional[int] = None) -> Iterator[str]:
    """Both built over one parameter, and the scheduler stepped over the run's `planned` optimizer steps (a few
    when they are not known here): its arithmetic runs at its steps, and the rates it gives must train."""
    from runner.schedulers import learning_rates

    try:
        optimizer = probe_optimizer(cfg.optimizer, [torch.zeros(1, requires_grad=True)])
    except _REFUSALS as error:
        yield (f"optimizer ({cfg.optimizer._target_}) does not accept its settings "
               f"({_settings('optimizer', cfg.optimizer)}): {_one_line(error)}")
        return
    if optimizer is None:
        return
    steps = list(_check_scheduler_steps(cfg))
    if steps:
        yield from steps
        return
    probed = min(planned, _PROBED_STEPS) if planned else 3
    try:
        with warnings.catch_warnings(), _quiet_runner_log():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": no training here
            # Without the planned count a stand-in; the worker passes the real one (and warns).
            scheduler = build_scheduler(cfg, optimizer, total_steps=planned or max(cfg.trainer.max_steps, 2))
            rates = learning_rates(scheduler, probed)
    except ConfigError as error:
        yield from error.problems
        return
    except _REFUSALS as error:
        steps = f"within the run's {planned} optimizer steps" if planned else "on its first steps"
        settings = _settings("scheduler", cfg.scheduler)
        yield (f"scheduler ({cfg.scheduler._target_}) fails {steps}{f' with {settings}' if settings else ''}: "
               f"{_one_line(error)}")
        return
    if planned:
        yield from _check_rates(cfg, rates, planned, optimizer)


def _check_rates(cfg: DictConfig, rates: list[float], planned: int, optimizer: Any) -> Iterator[str]:
    """The rates a schedule gives over the run's planned steps, named with the scheduler's settings."""
    from runner.schedulers import schedule_problem

    problem = schedule_problem(rates, planned, _reference_lr(cfg, optimizer))
    if problem:
        told = cfg.scheduler.get("total_steps")
        hint = (f" (scheduler.total_steps={told}, the run {planned}: leave scheduler.total_steps out and the runner "
                "passes the run's count)" if told is not None and told != planned else "")
        yield (f"scheduler ({cfg.scheduler._target_}: {_settings('scheduler', cfg.scheduler) or 'its defaults'}) "
               f"with optimizer.lr={optimizer.defaults.get('lr', 0.0):g}: {problem}{hint}")


# Settings of torch's schedulers counted in optimizer steps, which their constructors take unchecked, with the least
# value each means anything at (StepLR's step_size=-1 multiplies by gamma at every step).
_STEP_COUNTS = {"step_size": 1, "step_size_up": 1, "step_size_down": 1, "T_max": 1, "T_0": 1, "T_mult": 1,
                "total_iters": 0}


def _check_scheduler_steps(cfg: DictConfig) -> Iterator[str]:
    """Step counts below what they mean anything at, before a probe steps the scheduler with them."""
    for key, least in _STEP_COUNTS.items():
        value = cfg.scheduler.get(key)
        if _is_int(value) and value < least:
            yield (f"scheduler.{key}={value} must be a number of optimizer steps, at least {least} "
                   f"({cfg.scheduler._target_})")


def _reference_lr(cfg: DictConfig, optimizer: Any) -> float:
    """What a schedule's rates are measured against: optimizer.lr, or a peak the scheduler sets itself (max_lr)."""
    peak = cfg.scheduler.get("max_lr")
    peaks = list(peak) if OmegaConf.is_list(peak) else [peak] if isinstance(peak, (int, float)) else []
    return max([float(optimizer.defaults.get("lr", 0.0)), *(float(p) for p in peaks)])


def _trial_data(cfg: DictConfig) -> Any:
    """The data object, built here for the checks of its first batches and of the run's length; None when it
    cannot be built in this process (each worker builds its own and reports its own errors)."""
    with torch.random.fork_rng(devices=[]), _python_rng_kept(), _quiet_runner_log():
        try:
            return instantiate(cfg.data)
        except Exception:  # noqa: BLE001 - reported by the workers, where the data is built for the run
            return None


def _planned_steps(cfg: DictConfig, data: Any) -> Optional[int]:
    """The optimizer steps a fit takes from step 0, counted as the worker counts them (its scheduler's
    total_steps); None when not known here: no data, and trainer.max_steps alone does not decide."""
    from runner.loop import make_schedule

    t = cfg.trainer
    if cfg.get("stage", "fit") != "fit":
        return None
    steps_alone = t.max_steps if t.max_epochs is None and t.max_steps != -1 and not t.fast_dev_run else None
    try:
        processes = len(build_accelerator(cfg).parse_devices(devices_setting(cfg, instantiate(cfg.cluster))))
    except Exception:  # noqa: BLE001 - devices this machine lacks: _check_components says so
        processes = 0
    if data is None or processes < 1:
        return steps_alone
    # Each process takes len // processes samples (the sampler drops the tail), in whole batches.
    batches = len(data.train_dataset) // (processes * t.num_nodes) // data.batch_size
    total = make_schedule(t, batches, 0).total_steps
    return total if total >= 1 else None


def _check_data_and_schedule(cfg: DictConfig) -> Iterator[str]:
    """The data, built once: what the loop reads from it, whether its first samples form a batch, and the
    schedule's rates over the steps the run will take with it."""
    from runner.data import first_batch_problem

    data = _trial_data(cfg)
    stage = cfg.get("stage", "fit")
    splits = ("train", "val") if stage == "fit" else ({"validate": "val"}.get(stage, stage),)
    problem = data is not None and (_data_contract(cfg, data)
                                    or next(filter(None, (first_batch_problem(data, s) for s in splits)), None))
    if problem:
        yield problem if problem.startswith("data (") else f"data ({cfg.data._target_}): {problem}"
        data = None
    yield from _check_optimizer_and_scheduler(cfg, _planned_steps(cfg, data))


def _settings(group: str, node: DictConfig) -> str:
    """`group.key=value, ...` for the node's plain values: the keys a message about them should name."""
    values = OmegaConf.to_container(node, resolve=True)
    return ", ".join(f"{group}.{k}={v}" for k, v in values.items()
                     if not str(k).startswith("_") and isinstance(v, (bool, int, float, str, type(None))))


def _check_training_objects(cfg: DictConfig) -> Iterator[str]:
    yield from _check_data_and_schedule(cfg)
    try:
        build_task(cfg)
    except Exception as error:  # noqa: BLE001 - any refusal of the arguments is the user's to fix
        yield f"task ({cfg.task.get('_target_')}) does not accept its settings: {_one_line(error)}"
    yield from _check_top_k(cfg)
    yield from _check_metrics(cfg)
    yield from _check_callbacks(cfg)
    yield from _check_loggers(cfg)


def _check_loggers(cfg: DictConfig) -> Iterator[str]:
    """Each logger has the four methods of a logger and is built once in a scratch folder (it may create files)."""
    from runner.loggers import LOGGER_METHODS

    for name, spec in logger_specs(cfg).items():
        target = get_method(spec._target_)
        missing = [m for m in LOGGER_METHODS if not callable(getattr(target, m, None))]
        if missing:
            yield (f"logger.{name}._target_={spec._target_} is not a logger (it lacks {', '.join(missing)}): a logger "
                   "has log_metrics(metrics, step), resume_at(step), log_hyperparams(params, metrics) and finalize()")
            continue
        with tempfile.TemporaryDirectory() as scratch:
            try:
                logger = _build_one_logger(spec, Path(scratch))
                logger.finalize()
            except Exception as error:  # noqa: BLE001 - any refusal of the settings is the user's to fix
                if isinstance(error.__cause__ or error, ImportError):  # an optional package: mlflow, wandb
                    yield f"logger.{name} ({spec._target_}): {error.__cause__ or error}"
                else:
                    yield f"logger.{name} ({spec._target_}) does not accept its settings: {_one_line(error)}"
                continue
        # A logger that talks to a service says here whether it answers (a tracking server that is down).
        yield from (f"logger.{name}: {problem}" for problem in getattr(logger, "check_service", list)())


def _check_callbacks(cfg: DictConfig) -> Iterator[str]:
    from runner.callbacks import HOOKS
    from runner.signatures import check_settings

    node = cfg.get("callbacks")
    if OmegaConf.is_dict(node):  # each callback's keys against its class, naming the allowed ones
        keyed = [p for name, spec in node.items() if OmegaConf.is_dict(spec) and "_target_" in spec
                 for p in check_settings(f"callbacks.{name}", OmegaConf.merge(spec, _monitor_defaults(cfg, spec)))]
        keyed += _guessed_modes(cfg)
        if keyed:
            yield from keyed
            return
    try:
        callbacks = build_callbacks(cfg)
    except ConfigError as error:
        yield from error.problems
        return
    except Exception as error:  # noqa: BLE001 - a refused setting is the user's to fix
        yield f"callbacks: {_one_line(error)}"
        return
    for name, callback in callbacks.by_name.items():
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            yield (f"callbacks.{name} ({type(callback).__name__}) has none of the hooks {', '.join(HOOKS)}: "
                   "it would never be called")


def _check_top_k(cfg: DictConfig) -> Iterator[str]:
    """top_k beyond the data's classes is known before any batch when the data names its class count."""
    top_k, classes = cfg.task.get("top_k"), cfg.data.get("num_classes") if OmegaConf.is_dict(cfg.data) else None
    if OmegaConf.is_list(top_k) and _is_int(classes) and any(_is_int(k) and k > classes for k in top_k):
        yield f"task.top_k={list(top_k)} asks for more than data.num_classes={classes} classes"


def _check_metrics(cfg: DictConfig) -> Iterator[str]:
    from runner.metrics import STAGES, is_metric

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
            instantiate(spec)
        except Exception as error:  # noqa: BLE001
            yield (f"metrics.{name} ({spec._target_}) does not accept its settings: {_one_line(error)}"
                   f"{_unknown_settings(f'metrics.{name}', spec, target)}")


def _unknown_settings(key: str, spec: DictConfig, target: Any) -> str:
    """Keys that only a **kwargs took, which is where a misspelt one goes: `num_class` for `num_classes`."""
    from runner.signatures import parameters, suggest

    named = [n for n, p in (parameters(target) or {}).items()
             if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) and n != "self"]
    unknown = [str(k) for k in spec if not str(k).startswith("_") and str(k) not in named]
    return "".join(f"; {key}.{k} is not one of its parameters{suggest(k, named)}" for k in unknown) if named else ""


def _check_checkpoint(cfg: DictConfig, path: Any, processes: int) -> Iterator[str]:
    """The checkpoint is the one written (its checksums), holds data only, a possible step, finite weights and
    this run's task, and fits this config: the model's tensors and the position in the epoch."""
    from runner.checkpoint_io import CheckpointError

    try:
        checkpoint = _read_checked(cfg, path)
    except CheckpointError as err:
        yield f"trainer.ckpt_path={path}: {err}"
        return
    missing = [key for key in ("model", "optimizer", "step") if key not in checkpoint]
    if missing:
        yield f"trainer.ckpt_path={path} is not a runner checkpoint: it lacks {', '.join(missing)}"
        return
    per_step = cfg.data.get("batch_size", 1) * processes * cfg.trainer.accumulate_grad_batches
    samples = checkpoint.get("samples_in_epoch", 0)
    if samples % per_step and cfg.get("stage", "fit") == "fit":  # other stages take the weights only
        # The first step would train on part of a global batch (or skip samples): the data would not continue.
        yield (f"trainer.ckpt_path={path} stopped {samples} samples into an epoch, not a whole number of this "
               f"run's global batches (data.batch_size x processes x trainer.accumulate_grad_batches = {per_step}); "
               f"resume with its global batch ({checkpoint.get('global_batch_size')})")
    yield from _check_model_fits(cfg, path, checkpoint["model"])
    yield from _check_optimizer_state(cfg, path, checkpoint["optimizer"])


def _read_checked(cfg: DictConfig, path: Any) -> dict:
    """The checkpoint at `path` verified and checked (CheckpointError otherwise); a sharded folder's tensors on
    the meta device, its weights checked one stored chunk at a time. Nothing of it is unpickled beyond data."""
    from runner.checkpoint_io import CheckpointError, TorchCheckpointIO, sharded, trust

    # Without checksums only a checkpoint the user names: `last`/`best` may find any folder under outputs/.
    wanted = bool(cfg.trainer.get("trust_unchecked_checkpoint", False))
    trusted = wanted and cfg.trainer.ckpt_path not in ("last", "best")
    try:
        task = trust.task_name(build_task(cfg))
    except Exception:  # noqa: BLE001 - a task that cannot be built is reported by the task checks
        task = None
    try:
        if sharded.is_sharded(path):
            checkpoint = sharded.skeleton(path, trusted)
            trust.check(path, checkpoint, task, nonfinite=sharded.nonfinite_weights(path))
        else:
            checkpoint = trust.load_file(TorchCheckpointIO(), path, trusted)
            trust.check(path, checkpoint, task)
    except CheckpointError as error:
        if wanted and not trusted and "checksum" in str(error):
            raise CheckpointError(f"{error} (trainer.trust_unchecked_checkpoint=true is not taken for "
                                  f"trainer.ckpt_path={cfg.trainer.ckpt_path}, which may find any run's folder: "
                                  f"name this one, trainer.ckpt_path={path})") from None
        raise
    return checkpoint


def _check_optimizer_state(cfg: DictConfig, path: Any, saved: Any) -> Iterator[str]:
    """The configured optimizer keeps the per-parameter state the checkpoint holds (SGD's is not AdamW's).

    One step of the configured optimizer over one parameter says what it keeps; this imports torch._dynamo,
    which only a resumed run pays here (and an in-process run pays anyway for its first optimizer).
    """
    state = saved.get("state") if isinstance(saved, dict) else None
    if not state:
        return
    try:
        optimizer = probe_optimizer(cfg.optimizer, [torch.zeros(1, requires_grad=True)])
        if optimizer is None:
            return
        (parameter,) = optimizer.param_groups[0]["params"]
        parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
    except Exception:  # noqa: BLE001 - an optimizer that needs more than this probe is checked when it loads
        return
    expected, found = set(optimizer.state[parameter]), set(next(iter(state.values())))
    if not expected <= found:
        yield (f"trainer.ckpt_path={path} holds the state of another optimizer: optimizer={cfg.optimizer._target_} "
               f"keeps {', '.join(sorted(expected))} per parameter, the checkpoint {', '.join(sorted(found))}; "
               "resume with the optimizer it was saved with")


def _check_model_fits(cfg: DictConfig, path: Any, saved: dict) -> Iterator[str]:
    try:
        with torch.device("meta"):  # shapes only: no memory, no initialisation cost
            expected = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
    except Exception:  # noqa: BLE001 - a model that cannot be built on the meta device is checked when loaded
        return
    found = {k: tuple(v.shape) for k, v in saved.items()}
    differ = [f"{k} {found[k]} vs {shape}" for k, shape in expected.items() if k in found and found[k] != shape]
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if differ or missing or extra:
        details = "; ".join(filter(None, [
            differ and "shapes (checkpoint vs model) " + ", ".join(differ[:3]),
            missing and "missing " + ", ".join(missing[:3]),
            extra and "unexpected " + ", ".join(extra[:3]),
        ]))
        yield f"trainer.ckpt_path={path} holds another model than model={cfg.model.get('_target_')}: {details}"


def validate(cfg: DictConfig, ckpt_path: Any = None) -> None:
    """Raise ConfigError listing every problem of `cfg`; nothing is started before this passes."""
    problems = check_static(cfg)
    if problems:  # the checks below build objects, which needs importable, well-typed settings
        raise ConfigError(problems)
    problems += _check_signatures(cfg)
    if problems:  # building with keys a constructor does not take would only repeat them
        raise ConfigError(problems)
    problems += _check_components(cfg)
    problems += _check_half_optimizer(cfg)
    problems += _check_backend(cfg)
    problems += _check_trainable(cfg)
    problems += _check_training_objects(cfg)
    problems += _check_compile(cfg)
    problems += _check_fsdp(cfg)
    if ckpt_path is not None and not problems:
        devices = devices_setting(cfg, instantiate(cfg.cluster))
        processes = len(build_accelerator(cfg).parse_devices(devices)) * cfg.trainer.num_nodes
        problems += _check_checkpoint(cfg, ckpt_path, processes)
    if problems:
        raise ConfigError(problems)


