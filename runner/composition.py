"""Composing a config: the config groups registered with Hydra (the schemas, and the hooks that read a user's
option files), `compose` from Python, and the callbacks a config does not select dropped.

CLI → [compose] → validate → run folder → launch → worker → build → loop → teardown. Composing runs the first
checks (runner.checks.keys: removed groups, keys no schema has), so it stands above the checks package.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from runner.config import CONFIG_DIR, CONFIG_MODULE, ConfigError, register_resolvers
from runner.schemas import SCHEMAS, RunnerConfig

log = logging.getLogger("runner")


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


def _is_built_in(source: Any) -> bool:
    """Whether a config source is the runner's own groups: `pkg://runner.conf`, or their folder named as a file path."""
    if source.scheme() == "pkg":
        return source.path == CONFIG_MODULE
    return source.scheme() == "file" and os.path.realpath(source.path) == CONFIG_DIR


def _shown(source: str, config_path: str) -> str:
    """A config file of a source (`file://...`, `pkg://...`) as a user would type it: relative to the current folder
    where it is inside."""
    scheme, _, folder = source.partition("://")
    if scheme != "file":
        return f"{source}/{config_path}.yaml"
    path = os.path.join(os.path.abspath(folder), f"{config_path}.yaml")
    inside = os.path.relpath(path)
    return path if inside.startswith("..") else inside


# Lines about the user's files this command has said (a sweep composes once per job), each kept as its log record:
# they are said while composing, before the run folder's log is open, and written there once it is (said_lines).
_said: dict[str, logging.LogRecord] = {}


def _say_once(line: str) -> None:
    if line not in _said:
        record = log.makeRecord(log.name, logging.WARNING, __file__, 0, "%s", (line,), None)
        _said[line] = record
        if log.isEnabledFor(logging.WARNING):
            log.handle(record)


def said_lines() -> list[logging.LogRecord]:
    """What this command said about the user's config files while composing (which option shadows which), as log
    records, in order: for the run folder's log, which was not open yet."""
    return list(_said.values())


def forget_said_lines() -> None:
    """A new command (`runner.compose`, the command line's main) says its lines again."""
    _said.clear()


def _let_the_users_options_win() -> None:
    """An option of the user's folder (`--config-dir`, `hydra.searchpath`, `runner.compose(config_dir=...)`) with a
    built-in option's name is the one composed, with a line saying so once per command.

    Hydra reads the first source of its search path holding a config, and the runner's groups come first there
    (they are the app's config path): `my_conf/optimizer/adamw.yaml` was silently never read. The primary config
    stays the runner's, as in Hydra, where the app's config path comes before `--config-dir`; a user's
    `config.yaml` beside it is named as not read. Set on the repository, as the YAML errors above are.
    """
    from hydra._internal.config_repository import ConfigRepository
    from hydra.core.object_type import ObjectType

    find = ConfigRepository._find_object_source
    if getattr(find, "users_options_win", False):
        return

    def _find_object_source(self: Any, config_path: str, object_type: Any) -> Any:
        source = find(self, config_path, object_type)
        if object_type != ObjectType.CONFIG or source is None or not _is_built_in(source):
            return source
        later = self.sources[self.sources.index(source) + 1:]
        mine = next((s for s in later if s.provider != "schema" and not _is_built_in(s) and s.is_config(config_path)),
                    None)
        if mine is None:
            return source
        group, _, name = config_path.strip("/").rpartition("/")
        mine_shown = _shown(f"{mine.scheme()}://{mine.path}", config_path)
        if not group:  # the primary config
            _say_once(f"{mine_shown} is not read: the runner's own {name}.yaml stays the primary "
                      "config (put your defaults in an experiment, "
                      f"{os.path.join(os.path.dirname(mine_shown), 'experiment', '<name>.yaml')}, and choose it with "
                      "experiment=<name>)")
            return source
        _say_once(f"{mine_shown} shadows the built-in {group}={name}")
        return mine

    _find_object_source.users_options_win = True  # type: ignore[attr-defined]
    ConfigRepository._find_object_source = _find_object_source


def _package(result: Any, config_path: str) -> str:
    """Where a loaded option's keys go: its `# @package` header, else its group (`logger/csv` -> `logger`)."""
    package = (result.header or {}).get("package")
    if package in (None, "_group_"):
        return config_path.rpartition("/")[0].replace("/", ".")
    return "" if package == "_global_" else package.removeprefix("_global_.")


def _refuse_lightning_options() -> None:
    """A user's option file naming Lightning's Trainer, or one of its stock loggers or callbacks (a
    lightning-hydra-template tree: `trainer/default.yaml`, `logger/csv.yaml`), is one line naming the runner's
    equivalent, said as the file is read: Hydra cannot even merge a Trainer's `_target_` into the trainer group.
    """
    from hydra._internal.config_repository import ConfigRepository

    from runner.lightning.stock import lightning_classes

    load = ConfigRepository.load_config
    if getattr(load, "refuses_lightning", False):
        return

    @functools.wraps(load)  # keeps the flags of the wrapper it wraps
    def load_config(self: Any, config_path: str) -> Any:
        result = load(self, config_path)
        if result is None or result.provider == "schema" or not OmegaConf.is_dict(result.config):
            return result
        lines = lightning_classes(OmegaConf.to_container(result.config, resolve=False), _package(result, config_path))
        if lines:
            shown, (group, _, name) = _shown(result.path, config_path), config_path.rpartition("/")
            if group and any(_is_built_in(s) and s.is_config(config_path) for s in self.sources):
                lines[-1] += f" (remove or rename {shown}, which shadows the built-in {group}={name})"
            raise ConfigError([f"{shown}: {line}" for line in lines])
        return result

    load_config.refuses_lightning = True  # type: ignore[attr-defined]
    ConfigRepository.load_config = load_config


def register_configs() -> None:
    _share_the_config_store_in_copies()
    _name_yaml_errors_by_file()
    _let_the_users_options_win()
    _refuse_lightning_options()
    # Outside any group, so --help lists only the real options.
    store = ConfigStore.instance()
    store.store(name="runner_schema", node=RunnerConfig)
    for name, schema in SCHEMAS.items():
        store.store(name=f"runner_schema_{name}", node=schema)


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

    from runner.checks.keys import check_keys, check_overrides

    register_resolvers()
    register_configs()
    forget_said_lines()  # one command
    problems = check_overrides(overrides, CONFIG_DIR)
    if problems:
        raise ConfigError(problems)
    search_path = create_config_search_path(f"pkg://{CONFIG_MODULE}")
    if config_dir is not None:
        folder = Path(config_dir).resolve()
        if not folder.is_dir():
            raise ConfigError([f"config_dir={config_dir} is not a folder"])
        # Where --config-dir goes; an option of its with a built-in option's name wins (_let_the_users_options_win).
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
    drop_unselected_callbacks(cfg)
    problems = check_keys(cfg, CONFIG_DIR)  # what Hydra's `+key=value` lets through
    if problems:
        raise ConfigError(problems)
    return cfg


def drop_unselected_callbacks(cfg: DictConfig) -> None:
    """Turn off what the config sets for callbacks it does not select (an experiment's settings under
    `callbacks=none`), saying which, in one line."""
    from runner.checks.keys import drop_unselected_callbacks as drop

    dropped = drop(cfg, CONFIG_DIR)
    if dropped:
        log.info("dropped %s: settings of callbacks this run does not select (callbacks=%s)", ", ".join(dropped),
                 "[" + ",".join(cfg.callbacks or ()) + "]" if cfg.get("callbacks") else "none")
