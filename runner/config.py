"""Config schema, composition from Python, the run-folder resolver, and the checks a config passes before any
worker starts."""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf


class ConfigError(CompactHydraException):
    """A config that cannot run. Holds every problem found, each naming the key, the value and what is allowed.

    A compact Hydra error: raised where Hydra reports it (a callback, a sweeper), it prints as its message alone.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))

    def __str__(self) -> str:
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"invalid config ({len(self.problems)} problem{'s' if len(self.problems) > 1 else ''}):\n{lines}"


DEFAULT_EPOCHS = 5  # trainer.max_epochs when neither it nor trainer.max_steps is set


@dataclass
class TrainerConfig:
    devices: Any = "auto"  # int, -1 or 'auto' (all devices), or a list of device indices
    num_nodes: int = 1
    max_epochs: Optional[int] = None  # None: DEFAULT_EPOCHS, or no limit when max_steps is set; -1: no limit
    max_steps: int = -1  # -1: no limit
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    log_every_n_steps: int = 20
    val_check_interval: Any = 1.0  # float: fraction of an epoch; int: every N optimizer steps
    limit_train_batches: Any = 1.0  # float: fraction of the batches; int: number of batches
    limit_val_batches: Any = 1.0
    ckpt_every_n_steps: Optional[int] = None
    ckpt_path: Optional[str] = None  # a file, or 'last'
    trust_unchecked_checkpoint: bool = False  # load a ckpt_path named explicitly that carries no checksums
    seed: int = 0
    deterministic: bool = False
    fast_dev_run: Any = False  # true: 1 batch of training and validation; an int N: N batches
    max_restarts: int = 0  # restart the job's workers this often after a failure, resuming from last.ckpt
    skip_nonfinite_loss: bool = False  # skip optimizer steps whose gradients are NaN/inf instead of stopping
    keep_last_k: Optional[int] = None  # keep only the newest k periodic step-N.ckpt files
    compile: Any = False  # true: torch.compile the model with its loss; or torch.compile's arguments ({mode: ...})
    peak_tflops: Optional[float] = None  # one device's peak TFLOP/s for throughput/mfu; null: the known GPUs' table


@dataclass
class RunnerConfig:
    """The primary config's schema: `trainer` is typed here, the runner's other groups by their options' schemas
    (runner/schemas.py), the user's groups by their targets' signatures."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: Any = None
    accelerator: Any = None
    precision: Any = None
    checkpoint_io: Any = None
    cluster: Any = None
    model: Any = None
    data: Any = None
    optimizer: Any = None
    scheduler: Any = None
    task: Any = None
    callbacks: Any = None  # name -> callback spec (the `callbacks` group's options)
    metrics: Any = None  # name -> metric spec (or a list of specs)
    logger: Any = None
    stage: str = "fit"  # fit, validate, test or predict
    objective: str = "val/loss"  # the metric a sweep optimises
    direction: str = "minimize"
    # Free-form: the user's own keys, which the runner never reads (logged with the other settings).
    extras: Dict[str, Any] = field(default_factory=dict)
    tags: List[str] = field(default_factory=list)
    notes: Optional[str] = None


def _share_the_config_store_in_copies() -> None:
    """Make Hydra's copies of its config repository share the ConfigStore instead of deep-copying it.

    `--help` lists every group and option through a fresh copy of the repository (~120 copies), and each copy
    deep-copied the ConfigStore its structured source points to: with the schemas here and a sweeper
    plugin's, over a second of `--help`. A config source is its provider, its path and a handle on where its
    configs are read (the store is a process-wide singleton): a copy sharing them reads the same configs.
    Set on the base class, as Hydra's plugin discovery re-imports the module of the structured source.
    """
    from hydra.plugins.config_source import ConfigSource

    if "__deepcopy__" in vars(ConfigSource):
        return

    def __deepcopy__(self: Any, memo: dict) -> Any:
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        return copy

    ConfigSource.__deepcopy__ = __deepcopy__


def yaml_problem(error: Exception, path: Any = None) -> str:
    """`file:line:column: problem (context at line N)` for a YAML error, the file read from its mark."""
    mark = getattr(error, "problem_mark", None)
    where = path or getattr(mark, "name", None) or "a config file"
    if mark is not None:
        where = f"{getattr(mark, 'name', None) or where}:{mark.line + 1}:{mark.column + 1}"
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and context_mark is not None:
        problem += f" ({context} at line {context_mark.line + 1})"
    return f"{where}: not valid YAML: {problem}"


def _name_yaml_errors_by_file() -> None:
    """A YAML error in a config file (of `--config-dir`, a `hydra.searchpath` folder) is one line with the file
    and line, where Hydra prints ~90 lines through its defaults tree: raised as a ConfigError, which Hydra reports
    as its message alone. Only the files a composition reads are parsed, as before.

    Set on the repository, which every source's configs pass through: Hydra's plugin discovery re-imports the
    modules of the sources themselves (a new FileConfigSource class).
    """
    import yaml
    from hydra._internal.config_repository import ConfigRepository

    load = ConfigRepository.load_config
    if getattr(load, "names_yaml_errors", False):
        return

    def load_config(self: Any, config_path: str) -> Any:
        try:
            return load(self, config_path)
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            raise ConfigError([yaml_problem(error, f"{config_path}.yaml")]) from None

    load_config.names_yaml_errors = True  # type: ignore[attr-defined]
    ConfigRepository.load_config = load_config


def register_configs() -> None:
    from runner.schemas import SCHEMAS

    _share_the_config_store_in_copies()
    _name_yaml_errors_by_file()
    # Outside any group, so --help lists only the real options.
    store = ConfigStore.instance()
    store.store(name="runner_schema", node=RunnerConfig)
    for name, schema in SCHEMAS.items():
        store.store(name=f"runner_schema_{name}", node=schema)


# The config groups: the package runner.conf (`pkg://runner.conf` on Hydra's search path), inside a wheel, and
# conf/ at the top of a source checkout (see pyproject.toml's package-dir). The folder is wherever that package is.
CONFIG_MODULE = "runner.conf"
CONFIG_DIR = str(Path(importlib.import_module(CONFIG_MODULE).__file__).resolve().parent)


def compose(overrides: Sequence[str] = (), config_dir: Any = None) -> DictConfig:
    """The config `python -m runner [--config-dir DIR] <overrides>` would run (see `runner.compose`).

    Composed with a Hydra of its own: another app's (`@hydra.main`, `hydra.initialize()`) is put back afterwards.
    """
    from hydra import compose as hydra_compose
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.version import VersionBase, setbase

    register_resolvers()
    register_configs()
    problems = check_overrides(overrides)
    if problems:
        raise ConfigError(problems)
    search_path = create_config_search_path(f"pkg://{CONFIG_MODULE}")
    if config_dir is not None:
        folder = Path(config_dir).resolve()
        if not folder.is_dir():
            raise ConfigError([f"config_dir={config_dir} is not a folder"])
        # Where --config-dir goes: after the built-in groups, so it adds options and never hides one.
        search_path.prepend("runner.compose(config_dir)", f"file://{folder}", anchor=SearchPathQuery(provider="schema"))
    global_hydra, version = GlobalHydra.instance(), VersionBase.instance()
    outer, outer_version = global_hydra.hydra, version.getbase()
    global_hydra.clear()
    try:
        setbase("1.3")
        Hydra.create_main_hydra2(task_name="runner", config_search_path=search_path)
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    finally:
        global_hydra.clear()
        version.version_base = outer_version
        if outer is not None:
            global_hydra.initialize(outer)
    problems = check_keys(cfg)  # what Hydra's `+key=value` lets through
    if problems:
        raise ConfigError(problems)
    return cfg


_unique_dirs: dict[str, str] = {}


def unique_dir(path: str) -> str:
    """Create `path` (or `path-1`, `path-2`, ...) and return it, so runs started in one second never share it.

    Memoised per process: Hydra may resolve the run dir more than once within one run.
    """
    if path not in _unique_dirs:
        _unique_dirs[path] = make_unique_dir(path)
    return _unique_dirs[path]


def make_unique_dir(path: str) -> str:
    """Create and return `path`, or the first of `path-1`, `path-2`, ... that does not exist yet."""
    candidate, n = path, 0
    while True:
        try:
            os.makedirs(candidate, exist_ok=False)
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{path}-{n}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("unique_dir"):
        # Cached: Hydra copies the cache into each sweep job's config, so a job run elsewhere (a launcher
        # plugin's process) gets the sweep's folder instead of making another.
        OmegaConf.register_new_resolver("unique_dir", unique_dir, use_cache=True)


# -- checks ---------------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Groups every run needs: `~group` or `group=null` would remove one.
REQUIRED_GROUPS = ("strategy", "accelerator", "precision", "checkpoint_io", "cluster", "model", "data",
                   "optimizer", "scheduler", "task")
# torch.manual_seed and the samplers' generators take seeds up to 2**64 - 1; each epoch adds one.
_SEED_LIMIT = 2**63 - 1


def group_options(group: str) -> list[str]:
    folder = Path(CONFIG_DIR) / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _field_names(schema: Any) -> list[str]:
    return [f.name for f in fields(schema)]


def _check_groups_set(cfg: DictConfig) -> Iterator[str]:
    for group in REQUIRED_GROUPS:
        node = cfg.get(group)
        if node is None:
            hint = "; scheduler=constant keeps the learning rate constant" if group == "scheduler" else ""
            yield (f"{group} is not set ({group}=null and ~{group} remove the group): choose {group}=<option> "
                   f"({', '.join(group_options(group))}){hint}")
        elif not (OmegaConf.is_dict(node) and "_target_" in node):
            yield f"{group}={_show(node)} has no _target_: choose {group}=<option> ({', '.join(group_options(group))})"


def _show(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _check_keys(cfg: DictConfig) -> Iterator[str]:
    """Keys the schemas do not have, which Hydra's `+key=value` adds without a word (and nothing would read)."""
    from runner.signatures import suggest

    top = _field_names(RunnerConfig)
    trainer = _field_names(TrainerConfig)
    for key in cfg:
        if key in top or key == "hydra":  # hydra: a config composed with return_hydra_config=True
            continue
        if key in trainer:
            hint = f" (did you mean trainer.{key}?)"
        else:
            hint = suggest(str(key), top)
        yield (f"{key} is not a top-level key{hint}; allowed: {', '.join(top)} "
               f"(put keys of your own under extras, e.g. +extras.{key}=...)")
    node = cfg.get("trainer")
    for key in node if OmegaConf.is_dict(node) else ():
        if key in trainer:
            continue
        if key in top and group_options(str(key)):
            hint = f" ({key} is a config group: {key}=<option>, one of {', '.join(group_options(str(key)))})"
        else:
            hint = suggest(str(key), trainer)
        yield f"trainer.{key} is not a trainer setting{hint}; allowed: {', '.join(trainer)}"


def check_overrides(overrides: Sequence[str]) -> list[str]:
    """`group=null` on the command line, which Hydra fails on with a traceback; `~group` is its syntax."""
    problems = []
    for override in overrides:
        key, sep, value = override.partition("=")
        group = key.lstrip("+~")
        if sep and value.strip() == "null" and group_options(group):
            hint = "logger=none logs nothing; " if group == "logger" else ""
            problems.append(f"{group}=null is not an option of {group}: {hint}choose one of "
                            f"{', '.join(group_options(group))} (~{group} removes the group)")
    return problems


def check_keys(cfg: DictConfig) -> list[str]:
    """Problems of the config's shape: removed groups and keys nothing reads. No imports, no hardware."""
    return [*_check_groups_set(cfg), *_check_keys(cfg)]


def _check_trainer(t: DictConfig) -> Iterator[str]:
    devices = t.devices
    if not (devices == "auto" or (_is_int(devices) and (devices >= 1 or devices == -1)) or _is_index_list(devices)):
        yield (f"trainer.devices={devices} is not allowed: use a positive number of devices, -1 or 'auto' "
               "(all devices), or a list of device indices such as [0,1]")
    positive = ("num_nodes", "accumulate_grad_batches", "log_every_n_steps")
    for key in positive:
        if not (_is_int(t[key]) and t[key] >= 1):
            yield f"trainer.{key}={t[key]} must be a positive integer"
    for key in ("max_epochs", "max_steps"):
        if not (_is_int(t[key]) and (t[key] >= 1 or t[key] == -1)) and not (key == "max_epochs" and t[key] is None):
            yield f"trainer.{key}={t[key]} must be a positive integer, or -1 for no limit"
    if t.max_epochs == -1 and t.max_steps == -1 and not t.fast_dev_run:
        yield "trainer.max_epochs=-1 and trainer.max_steps=-1 would train forever: set one of them"
    if not (_is_int(t.max_restarts) and t.max_restarts >= 0):
        yield f"trainer.max_restarts={t.max_restarts} must be 0 (no restarts) or a positive integer"
    if t.gradient_clip_val is not None and not 0 < t.gradient_clip_val < math.inf:  # NaN fails both
        yield f"trainer.gradient_clip_val={t.gradient_clip_val} must be a positive number, or null for no clipping"
    if t.keep_last_k is not None and t.keep_last_k < 1:
        yield f"trainer.keep_last_k={t.keep_last_k} must be a positive integer, or null to keep every step-N.ckpt"
    if t.ckpt_every_n_steps is not None and t.ckpt_every_n_steps < 1:
        yield f"trainer.ckpt_every_n_steps={t.ckpt_every_n_steps} must be a positive integer, or null"
    for key in ("val_check_interval", "limit_train_batches", "limit_val_batches"):
        yield from _check_fraction_or_count(key, t[key], allow_zero=key == "limit_val_batches")
    if not (isinstance(t.fast_dev_run, bool) or (_is_int(t.fast_dev_run) and t.fast_dev_run >= 0)):
        yield f"trainer.fast_dev_run={t.fast_dev_run} must be true, false or a number of batches"
    if not (_is_int(t.seed) and 0 <= t.seed <= _SEED_LIMIT):
        yield f"trainer.seed={t.seed} must be an integer from 0 to 2**63-1"
    if t.get("peak_tflops") is not None and not 0 < t.peak_tflops < math.inf:
        yield f"trainer.peak_tflops={t.peak_tflops} must be a positive number (one device's TFLOP/s), or null"
    if not (isinstance(t.compile, bool) or OmegaConf.is_dict(t.compile)):
        yield (f"trainer.compile={t.compile} must be true, false, or torch.compile's keyword arguments, "
               "e.g. trainer.compile={mode:max-autotune}")


def _is_index_list(value: Any) -> bool:
    items = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
    return isinstance(items, (list, tuple)) and len(items) > 0 and all(_is_int(i) and i >= 0 for i in items)


def _check_fraction_or_count(key: str, value: Any, allow_zero: bool) -> Iterator[str]:
    low = 0 if allow_zero else 1
    if _is_int(value) and value >= low:
        return
    if isinstance(value, float) and (0.0 < value <= 1.0 or (allow_zero and value == 0.0)):
        return
    yield (f"trainer.{key}={value} is not allowed: use a fraction of an epoch in (0, 1] "
           f"or a whole number of batches >= {low}")


def _targets(node: Any, prefix: str) -> Iterator[tuple[str, str]]:
    if OmegaConf.is_dict(node):
        for key in node:
            if key == "_target_":
                yield prefix + "._target_", node[key]
            else:
                yield from _targets(node._get_node(key), f"{prefix}.{key}" if prefix else str(key))
    elif OmegaConf.is_list(node):
        for i, item in enumerate(node):
            yield from _targets(item, f"{prefix}[{i}]")


def _check_targets(cfg: DictConfig) -> Iterator[str]:
    for key, target in _targets(cfg, ""):
        module_name, _, attr = str(target).rpartition(".")
        try:
            getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as err:
            yield f"{key}={target} cannot be imported ({type(err).__name__}: {err}); check the module and name"


def _check_data(cfg: DictConfig) -> Iterator[str]:
    """The keys the runner's loaders read from any data object: batch_size, num_workers, pin_memory; and seed."""
    data = cfg.data
    batch_size = data.get("batch_size")
    if batch_size is not None and not (_is_int(batch_size) and batch_size >= 1):
        yield f"data.batch_size={batch_size} must be a positive integer (samples per process)"
    workers = data.get("num_workers")
    if workers is not None and not (_is_int(workers) and workers >= 0):
        yield f"data.num_workers={workers} must be 0 (load in the training process) or a positive number of processes"
    pin = data.get("pin_memory")
    if pin is not None and not isinstance(pin, bool):
        yield f"data.pin_memory={pin} must be true or false"
    seed = data.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed <= _SEED_LIMIT):
        yield f"data.seed={seed} must be an integer from 0 to 2**63-1"


def _check_stage(cfg: DictConfig) -> Iterator[str]:
    stage = cfg.get("stage", "fit")
    if stage not in ("fit", "validate", "test", "predict"):
        yield f"stage={stage} is not allowed: use fit, validate, test or predict"
    elif stage != "fit" and not cfg.trainer.ckpt_path:
        yield (f"stage={stage} needs the weights to use: trainer.ckpt_path=<file>, last or best "
               "(the newest of this run folder, else of a run of the same config)")


_CHOOSE_LOGGER = "choose logger=tensorboard, logger=csv, logger=none (no logger) or several: logger=[tensorboard,csv]"


def _check_logger(cfg: DictConfig) -> Iterator[str]:
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


def _check_objective(cfg: DictConfig) -> Iterator[str]:
    if cfg.get("direction") not in ("minimize", "maximize"):
        yield f"direction={cfg.get('direction')} is not allowed: use minimize or maximize (for objective={cfg.get('objective')})"
    if not (isinstance(cfg.get("objective"), str) and cfg.objective):
        yield f"objective={cfg.get('objective')} must name a metric, e.g. val/loss or val/acc"


def check_static(cfg: DictConfig) -> list[str]:
    """Problems that need no hardware look-up: shape, types, ranges, importable targets."""
    problems = check_keys(cfg)
    if problems:  # the checks below read the groups
        return problems
    problems = list(_check_trainer(cfg.trainer))
    problems += _check_stage(cfg)
    problems += _check_logger(cfg)
    problems += _check_objective(cfg)
    problems += _check_data(cfg)
    problems += _check_targets(cfg)
    return problems
