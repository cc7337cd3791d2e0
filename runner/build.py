"""The one place a valid config becomes objects (the only caller of hydra.utils.instantiate).

CLI → compose → validate → run folder → launch → worker → [build] → loop → teardown. The checks (runner.checks)
build trial objects through these functions before any worker starts; this module never imports them.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import json
import logging
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from runner.config import ConfigError
from runner.values import is_int, named_optimizers, one_line


def build_accelerator(cfg: DictConfig) -> Any:
    return instantiate(cfg.accelerator)


def build_precision(cfg: DictConfig, accelerator: Any) -> Any:
    # `device: auto` in the mixed-precision options follows the accelerator (autocast needs its device type).
    if cfg.precision.get("device") == "auto":
        return instantiate(cfg.precision, device=accelerator.device_type)
    return instantiate(cfg.precision)


def build_environment(cfg: DictConfig) -> Any:
    return instantiate(cfg.cluster)


def devices_setting(cfg: DictConfig, environment: Any) -> Any:
    """`trainer.devices`, where `auto` under torchrun or srun means the processes they started per node."""
    if cfg.trainer.devices == "auto" and environment.creates_processes_externally:
        return max(1, environment.world_size() // cfg.trainer.num_nodes)
    return cfg.trainer.devices


def build_strategy(cfg: DictConfig) -> Any:
    """accelerator -> precision -> checkpoint IO -> cluster environment -> strategy, as its constructor arguments."""
    accelerator = build_accelerator(cfg)
    environment = build_environment(cfg)
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


def build_data(cfg: DictConfig, strategy: Any = None, trainer: Any = None, beat: Any = None) -> Any:
    """The data, prepared (a data module's prepare_data once per node, its setup in every process, see
    runner.data.prepare), then checked: every process built the same (one collective), the loop can read it, its
    first samples form a batch, and the model and task take its batches (on the meta device: a model whose input
    width is not the data's fails with the sizes of both).

    Here, where each process builds its data anyway. The object is built once per process: where the checks before
    launch built it in this process, it is theirs (see DataHandOver). `beat`: the process's heartbeat, if watched.
    """
    from runner.data import prepare
    from runner.data.modules import rank_difference
    from runner.heartbeat import NoHeartbeat

    kept = _handed_over(cfg)
    data = prepare(build_unchecked_data(cfg) if kept is _NOTHING else kept, strategy, cfg.get("stage", "fit"),
                   trainer, beat or NoHeartbeat())  # a data module's `trainer`: the run's TrainerView
    # The agreement first, on every process alike: it is a collective, which a process that raised would not reach.
    problem = (rank_difference(data, strategy) or data_contract(cfg, data) or first_batches_problem(cfg, data)
               or model_data_mismatch(cfg, data))
    if problem:
        raise ConfigError([problem])
    return data


def build_unchecked_data(cfg: DictConfig) -> Any:
    """The data object as its settings make it, before build_data's checks (the checks' trial build)."""
    return instantiate(cfg.data)


_NOTHING = object()  # nothing handed over: build the data
_DRAWS = object()  # handed over in words only: its construction drew from the global random number generators


class DataHandOver:
    """The data object the checks before launch built, for the worker that trains in the same process (one process;
    a rank torchrun or srun started) to take instead of building it again: one build per process.

    `trains_here` says whether a worker of this process will build the data (else launched workers each build their
    own); asked once, when the checks come to the data. An object whose construction drew from the global random
    number generators is not handed over: the worker builds its own after seeding with trainer.seed, as a run
    always did, so the run's numbers stay what they were.
    """

    def __init__(self, trains_here: Callable[[], bool]) -> None:
        self._ask, self._answer, self._kept = trains_here, None, ("", _NOTHING)

    def trains_here(self) -> bool:
        if self._answer is None:
            try:
                self._answer = bool(self._ask())
            except Exception:  # noqa: BLE001 - a strategy that cannot be built: the checks say why, nothing runs
                self._answer = True
        return self._answer

    def offer(self, cfg: DictConfig, data: Any, drew_random: bool) -> None:
        self._kept = (_data_key(cfg), _DRAWS if drew_random else data)

    def take(self, cfg: DictConfig) -> Any:
        """The object offered for `cfg`'s data settings (once), `_DRAWS`, or `_NOTHING`."""
        key, data = self._kept
        self._kept = ("", _NOTHING)
        return data if key == _data_key(cfg) else _NOTHING


_HAND_OVER: contextvars.ContextVar[Optional[DataHandOver]] = contextvars.ContextVar("data_hand_over", default=None)


@contextlib.contextmanager
def handing_over_data(trains_here: Callable[[], bool]) -> Iterator[DataHandOver]:
    """While this lasts (a job, from its checks to its end), the checks may hand the data they build to the worker of
    this process (data_hand_over); outside it they keep nothing."""
    token = _HAND_OVER.set(DataHandOver(trains_here))
    try:
        yield _HAND_OVER.get()
    finally:
        _HAND_OVER.reset(token)


def data_hand_over() -> Optional[DataHandOver]:
    """The running job's hand-over, if any (the checks offer the data to it, build_data takes it)."""
    return _HAND_OVER.get()


def _handed_over(cfg: DictConfig) -> Any:
    hand_over = data_hand_over()
    data = hand_over.take(cfg) if hand_over is not None else _NOTHING
    if data is _DRAWS:
        logging.getLogger("runner").info(
            "data: built again for training: its construction draws from the global random number generators, "
            "which trainer.seed sets here (data built with a torch.Generator of its own is built once)")
        return _NOTHING
    return data


def _data_key(cfg: DictConfig) -> str:
    """The data's settings, resolved: a check and the worker build the same object from the same ones."""
    return json.dumps(OmegaConf.to_container(cfg.data, resolve=True), sort_keys=True, default=str)


def global_rng_states() -> tuple:
    """The global random number generators' states: torch's (CPU, and CUDA once initialised), Python's, and
    NumPy's once imported. Two that differ tell that something drew from one of them."""
    cuda = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else []
    numpy = sys.modules.get("numpy")
    legacy = numpy.random.get_state() if numpy is not None else None
    return (torch.get_rng_state().numpy().tobytes(), tuple(cuda), random.getstate(),
            None if legacy is None else (legacy[0], legacy[1].tobytes(), *legacy[2:]))


def data_contract(cfg: DictConfig, data: Any) -> Optional[str]:
    """What the data object lacks of what the loop reads from it (README, "Your own model and data")."""
    from runner.data.streams import is_stream

    what = f"data ({cfg.data._target_})"
    batch_size = getattr(data, "batch_size", None)
    if not (is_int(batch_size) and batch_size > 0):
        return (f"{what} has batch_size={batch_size!r}: a data object needs a positive integer batch_size (per "
                "process) beside train_dataset")
    fit = cfg.get("stage", "fit") == "fit"
    for name in ("train_dataset", "val_dataset", "test_dataset", "predict_dataset"):
        dataset = getattr(data, name, None)
        if dataset is None and fit and name == "train_dataset":
            return (f"{what} has no train_dataset: a data object needs one (a map-style dataset or a stream), made "
                    "by its constructor or its setup(stage), or a train_dataloader() method")
        if dataset is None:
            continue
        if not (is_stream(dataset) or (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))):
            return (f"{what}.{name} is {type(dataset).__name__}: neither a map-style dataset (len() and indexing) "
                    "nor a stream (an IterableDataset, or __iter__ without indexing)")
    return endless_evaluation(cfg, data)


def endless_evaluation(cfg: DictConfig, data: Any) -> Optional[str]:
    """An evaluation stream without len() and no number of batches to read of it: its pass would end only where
    the stream does, which may be never."""
    from runner.data import STAGE_SPLITS
    from runner.data.streams import is_stream, stream_length

    stage, t = cfg.get("stage", "fit"), cfg.trainer
    splits = [s for s in STAGE_SPLITS[stage] if s != "train"] + (["test"] if stage == "fit" else [])
    for split in splits:
        dataset, key = getattr(data, f"{split}_dataset", None), f"limit_{split}_batches"
        limit = t.get(key, 1.0)
        if dataset is None or not is_stream(dataset) or stream_length(dataset) is not None:
            continue
        if is_int(limit) or t.fast_dev_run or (split == "val" and limit == 0):
            continue
        return (f"trainer.{key}={limit}: data.{split}_dataset ({type(dataset).__name__}) is a stream without "
                f"len(), so its pass would read it to its end, however long; give the number of batches each "
                f"process reads of it (trainer.{key}=N){', or 0 to skip validation' if split == 'val' else ''}")
    return None


def first_batches_problem(cfg: DictConfig, data: Any) -> Optional[str]:
    """Why the first samples of a split the stage reads do not form a batch, named with the data's class."""
    from runner.data import STAGE_SPLITS, first_batch_problem

    splits = STAGE_SPLITS[cfg.get("stage", "fit")]
    problem = next(filter(None, (first_batch_problem(data, split) for split in splits)), None)
    return problem and f"data ({cfg.data._target_}): {problem}"


def build_task(cfg: DictConfig) -> Any:
    from runner.lightning import is_lightning_config

    if is_lightning_config(cfg):  # a LightningModule's own steps are its task (the config's task is not used)
        from runner.lightning.task import LightningTask

        return LightningTask()
    return instantiate(cfg.task)


# Integer settings that are not sizes of a tensor, left out of a size mismatch's message.
_NOT_SIZES = ("seed", "num_workers", "num_samples", "val_samples", "batch_size")


def meta_model(cfg: DictConfig) -> Any:
    """The config's model built on the meta device (shapes only, the random generators left as they were), for the
    checks before launch; None when the meta device cannot build it (the workers then report what fails)."""
    try:
        with torch.random.fork_rng(devices=[]), python_rng_kept(), torch.device("meta"):
            return build_model(cfg)
    except Exception:  # noqa: BLE001 - a model the meta device cannot build is checked in the workers
        return None


# A model this small, for a run on the CPU, is tried on the CPU rather than the meta device: its real kernels over
# two samples cost less than the machinery torch's meta kernels import at their first call (sympy, ~0.3 s of CPU).
# A run on another device keeps the meta device: its model may hold kernels of that device alone.
TRIAL_ON_CPU_PARAMETERS = 1 << 22


def trial_model(cfg: DictConfig) -> tuple[Any, str]:
    """(the model, its device) for a trial over two samples: built on the meta device (shapes only, no memory), or,
    for a CPU run with at most TRIAL_ON_CPU_PARAMETERS parameters, on the CPU. The caller keeps the random generators
    as they were."""
    with torch.device("meta"):
        model = build_model(cfg)
    if (not isinstance(model, torch.nn.Module) or sum(p.numel() for p in model.parameters()) > TRIAL_ON_CPU_PARAMETERS
            or build_accelerator(cfg).device_type != "cpu"):
        return model, "meta"
    with torch.device("cpu"):
        return build_model(cfg), "cpu"


def model_data_mismatch(cfg: DictConfig, data: Any) -> Optional[str]:
    """What goes wrong when two samples of the data pass through the model and task on the meta device (a small
    model on the CPU: `trial_model`).

    Shapes only for a large model (no memory, no initialisation); the random number generators are left as they
    were. None when they fit, or when the model or its operations cannot run on the meta device (the worker then
    reports its own errors).
    """
    from runner.data import collate
    from runner.precision import DoublePrecision, Precision
    from runner.tasks import BatchError, TaskModule
    from runner.tree import apply_to_tensors

    with torch.random.fork_rng(devices=[]), python_rng_kept():
        try:
            dataset = data.train_dataset
            samples = [dataset[i] for i in range(min(2, len(dataset)))]
            model, device = trial_model(cfg)
            batch = apply_to_tensors(getattr(data, "collate_fn", collate)(samples), lambda t: t.to(device))
            # In the run's own dtype where it is one (64-true: float64 data meets a float64 model, as in the run).
            precision = build_precision(cfg, build_accelerator(cfg))
            precision = precision if isinstance(precision, DoublePrecision) else Precision()
            module = TaskModule(precision.convert_module(model), build_task(cfg), precision)
        except Exception:  # noqa: BLE001 - built for real by the worker, which reports its own errors
            return None
        if not samples:
            return None
        try:
            with torch.no_grad():
                module(batch)
        except BatchError as error:  # the task's own reading of the batch (its target, its units)
            return f"task ({cfg.task._target_}) with data ({cfg.data._target_}): {one_line(error)}"
        except (TypeError, AttributeError) as error:  # AttributeError: the model reads a field the batch lacks
            if isinstance(error, TypeError) and not re.search(
                    r"forward\(\) (got an unexpected keyword|missing \d+ required)|must be Tensor, not ", str(error)):
                return None
            keys = (f" with the keys {', '.join(map(str, batch))}" if isinstance(batch, dict)
                    else f" (each a {type(batch).__name__}, which task=model passes to the model whole)"
                    if not module.task.takes_pairs else "")
            return (f"model ({cfg.model._target_}) cannot be called on the batches of data ({cfg.data._target_})"
                    f"{keys}: {one_line(error)}")
        except (RuntimeError, ValueError, IndexError) as error:
            if "meta" in str(error).lower():  # an operation the meta device cannot run: not a size problem
                return None
            return (f"model ({cfg.model._target_}) does not take the batches of data ({cfg.data._target_}): "
                    f"{one_line(error)}; sizes: {_sizes('model', cfg.model)}; {_sizes('data', cfg.data)}")
        except Exception:  # noqa: BLE001
            return None
    return None


def _sizes(group: str, node: DictConfig) -> str:
    values = OmegaConf.to_container(node, resolve=True)
    return ", ".join(f"{group}.{k}={v}" for k, v in values.items()
                     if is_int(v) and k not in _NOT_SIZES) or f"{group}: no integer settings"


@contextlib.contextmanager
def python_rng_kept() -> Iterator[None]:
    """`random`'s state put back after a trial build, as torch.random.fork_rng puts back torch's."""
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


def monitor_defaults(cfg: DictConfig, spec: DictConfig) -> dict:
    """An unset `monitor`/`mode` of a callback follows the run's `objective`/`direction`."""
    defaults = {"monitor": cfg.get("objective", "val/loss"),
                "mode": "max" if cfg.get("direction") == "maximize" else "min"}
    return {key: value for key, value in defaults.items() if key in spec and spec[key] is None}


def guessed_modes(cfg: DictConfig) -> Iterator[str]:
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

    checks = ({"objective check": ObjectiveCheck(str(cfg.objective), cfg.get("direction", "minimize"))}
              if cfg.get("objective") else {})
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
        defaults = monitor_defaults(cfg, spec)
        built[str(name)] = instantiate(spec, **defaults)
        if "monitor" in defaults:  # an unset monitor follows the objective, also where the run ranks by its own
            built[str(name)].follows_objective = True
    problems = list(guessed_modes(cfg))
    if problems:
        raise ConfigError(problems)
    return Callbacks(built)


def build_metrics(cfg: DictConfig, strategy: Any) -> Any:
    from runner.metrics import MetricSet

    return MetricSet({name: (build_metric(spec), stages) for name, (spec, stages) in metric_specs(cfg).items()},
                     strategy)


def build_metric(spec: DictConfig) -> Any:
    return instantiate(spec)


def build_optimizer(cfg: DictConfig, parameters: Any) -> Any:
    """The optimizer over `parameters` (a model, or its parameters, already on their device); AdamW, Adam and SGD
    run fused on CUDA. With `optimizer._no_decay_` (a model given) the parameters come in two groups: those it
    names get weight_decay 0.0, the others the configured weight_decay."""
    from runner.lightning.detect import is_lightning_module

    if is_lightning_module(parameters):  # its configure_optimizers() (the config's optimizer is not used)
        from runner.lightning.optimizers import configure

        return configure(parameters)
    parts = named_optimizers(cfg.optimizer)
    if parts is not None:
        return optimizer_set(parts, parameters)
    node = cfg.optimizer
    model, entries = parameters, list(node.get(NO_DECAY) or ())
    parameters = decay_groups(parameters, entries) if isinstance(parameters, torch.nn.Module) else list(parameters)
    extra = fused_setting(node, {t.device.type for t in _tensors(parameters)})
    if extra:
        logging.getLogger("runner").info("optimizer: fused=True (every parameter is on CUDA); +optimizer.foreach=true "
                                         "runs torch's own default, the multi-tensor update, instead")
    settings = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != NO_DECAY}
    try:
        optimizer = instantiate(OmegaConf.create(settings))(parameters, **extra)
    except (TypeError, ValueError) as error:  # e.g. lr=-1: a config problem, not a bug
        raise ConfigError([f"optimizer ({node._target_}) does not accept its settings: "
                           f"{one_line(error)}"]) from error
    if entries and isinstance(model, torch.nn.Module):  # its index i is no longer the model's i-th parameter
        from runner.checkpoint_io.optimizer_keys import record_names

        record_names([optimizer], model)
    return optimizer


def optimizer_set(parts: dict[str, DictConfig], model: Any) -> Any:
    """Several named optimizers, each over the part of the model its `_params_` names (with its own `_no_decay_`),
    as one OptimizerSet; each parameter group carries its optimizer's name (lr/<name> in the logs)."""
    from runner.loop.optimizers import PARAMS, OptimizerSet, assign_parts

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(["optimizer: named optimizers take their parameters from the model by name; got "
                           f"{type(model).__name__}"])
    taken, problems = assign_parts(model, parts)
    if problems:
        raise ConfigError(problems)
    named = dict(model.named_parameters())
    optimizers = []
    for name, node in parts.items():
        entries = list(node.get(NO_DECAY) or ())
        exempt = {n for found in no_decay_matches(model, entries).values() for n in found} if entries else set()
        groups = [{"params": [named[n] for n in taken[name] if n not in exempt], "name": name},
                  {"params": [named[n] for n in taken[name] if n in exempt], "weight_decay": 0.0,
                   "name": f"{name}/{NO_DECAY.strip('_')}"}]
        groups = [group for group in groups if group["params"]]
        extra = fused_setting(node, {t.device.type for t in _tensors(groups)})
        settings = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in (NO_DECAY, PARAMS)}
        try:
            optimizers.append(instantiate(OmegaConf.create(settings))(groups, **extra))
        except (TypeError, ValueError) as error:
            raise ConfigError([f"optimizer.{name} ({node._target_}) does not accept its settings: "
                               f"{one_line(error)}"]) from error
    from runner.checkpoint_io.optimizer_keys import record_names

    record_names(optimizers, model)  # each optimizer's state keyed by parameter name in sharded checkpoints
    return OptimizerSet(optimizers, list(parts))


# `optimizer._no_decay_`: the runner's own key in the optimizer group (as `_stages_` in a metric's), which the
# optimizer's constructor never sees. Its entries: `bias` (parameters whose name ends in bias), `norm` (the
# parameters of normalization layers), or any other text, found in a parameter's full name.
NO_DECAY = "_no_decay_"
NORM_LAYERS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm, torch.nn.LocalResponseNorm,
               torch.nn.modules.batchnorm._NormBase)


def is_norm_layer(module: torch.nn.Module) -> bool:
    """torch's normalization layers (batch, instance, layer, group, RMS), and any class whose name ends in Norm
    (LlamaRMSNorm, T5LayerNorm, ...)."""
    return isinstance(module, NORM_LAYERS) or type(module).__name__.endswith("Norm")


def no_decay_matches(model: torch.nn.Module, entries: list[str]) -> dict[str, list[str]]:
    """{entry: the names of the parameters it exempts from weight decay}, in the model's order."""
    in_norm = {id(p) for m in model.modules() if is_norm_layer(m) for p in m.parameters(recurse=False)}

    def matches(entry: str, name: str, parameter: torch.Tensor) -> bool:
        if entry == "bias":
            return name.endswith("bias")
        if entry == "norm":
            return id(parameter) in in_norm
        return entry in name

    named = list(model.named_parameters())
    return {entry: [name for name, p in named if matches(entry, name, p)] for entry in entries}


def decay_groups(model: torch.nn.Module, entries: list[str]) -> list:
    """The model's parameters, in two groups when `entries` exempt some: [{the others}, {those, weight_decay 0}],
    named `decay` and `no_decay` (their rates are logged as lr/decay and lr/no_decay)."""
    if not entries:
        return list(model.parameters())
    exempt = {name for names in no_decay_matches(model, entries).values() for name in names}
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n not in exempt], "name": "decay"},
              {"params": [p for n, p in named if n in exempt], "weight_decay": 0.0, "name": NO_DECAY.strip("_")}]
    return [group for group in groups if group["params"]]


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



def build_scheduler(cfg: DictConfig, optimizer: Any, total_steps: Optional[int] = None) -> Any:
    """The scheduler for `optimizer`; one that takes `total_steps` and leaves it unset gets the run's count."""
    from runner.lightning.optimizers import schedules_for

    configured = schedules_for(optimizer)  # an optimizer a LightningModule configured: its own schedulers
    if configured is not None:
        return configured
    try:
        return instantiate(cfg.scheduler)(optimizer, **_scheduler_extra(cfg, total_steps))
    except (TypeError, ValueError) as error:
        raise ConfigError([f"scheduler ({cfg.scheduler._target_}) does not accept its settings: "
                           f"{one_line(error)}"]) from error


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
    """Rank 0 gets the configured loggers (several as one LoggerSet); the other ranks (and trainer.fast_dev_run)
    loggers that do nothing, one standing in for each (its folders, for Lightning code that reads them)."""
    from runner.loggers import LoggerSet, NullLogger

    specs = logger_specs(cfg).values()
    loggers = [build_one_logger(spec, run_dir) if enabled else _stand_in(spec, run_dir) for spec in specs]
    if not loggers:
        return NullLogger()
    return loggers[0] if len(loggers) == 1 else LoggerSet(loggers)


def _stand_in(spec: DictConfig, run_dir: Path) -> Any:
    """What another rank has for the logger `spec` builds on rank 0: one that does nothing, with its folders."""
    from runner.loggers import NullLogger

    root = Path(spec.get("root_dir") or run_dir)
    subdir = spec.get("subdir")  # a logger writing in a folder of the run's (TensorBoard's)
    return NullLogger(save_dir=str(root), log_dir=str(root / subdir) if subdir else str(root), name=subdir,
                      stands_in=True)


def build_one_logger(spec: DictConfig, run_dir: Path) -> Any:
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
