"""Hydra's internals as the command line needs them: each a context manager, in effect only while `python -m runner`
runs (runner.cli.main), so that `runner.compose` and other apps' Hydra keep Hydra's own behaviour; one exception,
`write_hydra_records_whole`, set when runner.cli is imported (see why there)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

from omegaconf import DictConfig, OmegaConf

from runner.config import ConfigError
from runner.errors import say

# What a typed key takes, by the OmegaConf node that holds it (the schemas' int, float, bool and str fields).
_TAKES = {"IntegerNode": "an integer", "FloatNode": "a number", "BooleanNode": "true or false",
          "StringNode": "a string"}


def wrong_type(override: Any, error: Any) -> str:
    """`trainer.max_steps=abc is not an integer (trainer.max_steps takes an integer, e.g. trainer.max_steps=-1)`:
    the key, the value as typed and the type, for OmegaConf's ValidationError on merging an override."""
    key = error.full_key or override.key_or_group
    typed = (override.input_line or "").partition("=")[2]
    node = error.child_node
    takes = _TAKES.get(type(node).__name__)
    if takes is None:  # an enum, a list, a dict: OmegaConf's own first line says it
        return f"{key}={typed}: {str(error.msg).splitlines()[0]}"
    value = override.value()
    if isinstance(value, float) and value.is_integer() and takes == "an integer":
        example = int(value)  # 1e1 is a float to Hydra's parser
    else:
        example = node._value()  # the value the config holds without this override
    optional = " or null" if node._is_optional() else ""
    hint = f", e.g. {key}={example}" if example is not None and not OmegaConf.is_config(example) else ""
    return f"{key}={typed} is not {takes} ({key} takes {takes}{optional}{hint})"


def unknown_key(override: Any, cfg: DictConfig) -> str:
    """`trainer.precision=bf16-mixed: the config has no key trainer.precision (precision is a config group: ...)`,
    for an override of a key the config lacks (Hydra's six lines suggest `+key`, which the checks then refuse for a
    schema's keys)."""
    from runner.checks.keys import group_options
    from runner.config import CONFIG_DIR
    from runner.values import suggest

    key = override.key_or_group
    typed = (override.input_line or "").partition("=")[2]
    parent, _, name = key.rpartition(".")
    options = group_options(name, CONFIG_DIR)
    if options:
        return (f"{key}={typed}: the config has no key {key} ({name} is a config group: {name}=<option>, one of "
                f"{', '.join(options)})")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    siblings = [str(k) for k in node] if OmegaConf.is_dict(node) else []
    hint = suggest(name, siblings).replace("did you mean ", f"did you mean {parent}." if parent else "did you mean ")
    return f"{key}={typed}: the config has no key {key}{hint}; +{key}={typed} adds one, where its group takes it"


@contextlib.contextmanager
def wrong_types_in_one_line() -> Iterator[None]:
    """A value of the wrong type for a typed key (`trainer.max_steps=abc`, also in a sweep's `abc,5`) is one line,
    exit 1, where Hydra prints six of its own: OmegaConf's ValidationError while Hydra merges that override,
    caught at Hydra's merge of the overrides (a sweep's jobs are composed there too, before any job runs). Only
    while the command line runs: `runner.compose` keeps raising Hydra's exception to its caller."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    merge = ConfigLoaderImpl.__dict__["_apply_overrides_to_config"]

    def one_by_one(overrides: list, cfg: DictConfig) -> None:
        for override in overrides:  # Hydra merges them in order, one at a time, as here
            try:
                merge.__func__([override], cfg)
            except ConfigCompositionException as error:
                cause = error.__cause__
                unknown = isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and not (
                    override.is_add() or override.is_force_add() or override.is_delete())
                if not (isinstance(cause, ValidationError) or unknown) or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                line = unknown_key(override, cfg) if unknown else wrong_type(override, cause)
                say(line)
                raise SystemExit(1) from None

    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(one_by_one)
    try:
        yield
    finally:
        ConfigLoaderImpl._apply_overrides_to_config = merge


@contextlib.contextmanager
def unknown_options_in_one_line() -> Iterator[None]:
    """An option a config group does not have (`optimizer=lion`, `callbacks=[early_stopping,bogus]`,
    `hydra/launcher=bogus`, a user's defaults list naming one, a sweep's value) is one line, exit 1, where Hydra
    prints 8 to 13 of its own (its search path among them): the group's options (the user's folder's too), the
    closest one, and the file whose defaults list named it when that is not the command line. Only while the command
    line runs; the primary config missing keeps Hydra's words."""
    from hydra._internal import defaults_list

    from runner.checks.keys import not_an_option

    not_found, override = defaults_list.config_not_found_error, defaults_list.Overrides.override_default_option

    def override_default_option(self: Any, default: Any) -> None:
        override(self, default)  # an `override /group: option` of a config file: which file, for the line below
        meta = self.override_metadata.get(default.get_override_key())
        if meta is not None and not meta.external_override:
            default.runner_chosen_in = meta.containing_config_path

    def config_not_found_error(repo: Any, tree: Any) -> None:
        element = tree.node
        group, name = element.get_group_path(), element.get_name()
        options = repo.get_group_options(group, _config_type()) if group else []
        if element.primary or not group or not name or os.environ.get("HYDRA_FULL_ERROR") == "1":
            not_found(repo=repo, tree=tree)
        parent = tree.parent.node.get_config_path() if tree.parent is not None else None
        chosen_in = getattr(element, "runner_chosen_in", None) or parent
        where = "" if chosen_in in (None, "config") else _defaults_of(repo, chosen_in)
        say(not_an_option(group, name, options, where))
        raise SystemExit(1)

    defaults_list.config_not_found_error = config_not_found_error
    defaults_list.Overrides.override_default_option = override_default_option
    try:
        yield
    finally:
        defaults_list.config_not_found_error = not_found
        defaults_list.Overrides.override_default_option = override


def _config_type() -> Any:
    from hydra.core.object_type import ObjectType

    return ObjectType.CONFIG


def _defaults_of(repo: Any, config_path: str) -> str:
    """`named in the defaults of my_conf/experiment/mine.yaml`: the user's file that holds `config_path`'s defaults
    list ('' for the runner's and Hydra's own)."""
    from runner.composition import _shown

    source = next((s for s in repo.get_sources() if s.is_config(config_path)), None)
    if source is None or source.provider in ("hydra", "main", "schema"):  # Hydra's own or the runner's: not the user's
        return ""
    return f"named in the defaults of {_shown(f'{source.scheme()}://{source.path}', config_path)}"


@contextlib.contextmanager
def composed_once() -> Iterator[None]:
    """A run (not -m) composes its config once, where Hydra composes it twice: once to read `hydra.mode`
    (Hydra.get_mode, in multirun mode), then again to run it, ~0.15 s each (a twentieth of `stage=check`).

    Here get_mode composes the config as the run will (run mode, the same overrides) and the run takes that very
    config. Where hydra.mode is unset, Hydra runs with `hydra.mode=RUN` added to the overrides: the config gets what
    that override gives (the mode, and the line in hydra.overrides.hydra). Where this composition fails (a sweep's
    values without -m, an option that does not exist) or gives a multirun preset, Hydra's own get_mode answers and
    the run composes as before, raising its own error."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra.types import RunMode

    get_mode, load = Hydra.__dict__["get_mode"], ConfigLoaderImpl.__dict__["load_configuration"]
    composed: dict[tuple, DictConfig] = {}

    def get_mode_composing_the_run(self: Any, config_name: Optional[str], overrides: list[str]) -> Any:
        try:
            cfg = load(self.config_loader, config_name=config_name, overrides=overrides, run_mode=RunMode.RUN)
        except Exception:  # noqa: BLE001 - Hydra's own get_mode decides, and the run reports the error
            return get_mode(self, config_name, overrides)
        mode, run_overrides = cfg.hydra.mode, list(overrides)
        if mode == RunMode.MULTIRUN:
            return mode
        if mode is None:  # what Hydra's _run_app adds before the run composes
            cfg.hydra.mode = RunMode.RUN
            cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
            run_overrides.append("hydra.mode=RUN")
        composed[(config_name, tuple(run_overrides))] = cfg
        return mode

    def load_configuration(self: Any, config_name: Optional[str], overrides: list[str], run_mode: Any,
                           **kwargs: Any) -> DictConfig:
        cfg = composed.pop((config_name, tuple(overrides)), None) if run_mode == RunMode.RUN else None
        return cfg if cfg is not None else load(self, config_name, overrides, run_mode, **kwargs)

    Hydra.get_mode, ConfigLoaderImpl.load_configuration = get_mode_composing_the_run, load_configuration
    try:
        yield
    finally:
        Hydra.get_mode, ConfigLoaderImpl.load_configuration = get_mode, load


@contextlib.contextmanager
def linked_log_in_one_line() -> Iterator[None]:
    """A symbolic link planted at the run folder's runner.log is refused in one line, exit 1, before the job writes
    anything there: Hydra's job logging opens that file through runner.logs.NoFollowFileHandler
    (conf/hydra/job_logging/runner.yaml), whose refusal logging's dictConfig wraps in a ValueError that Hydra prints
    as a traceback. Only while the command line runs."""
    from hydra.core import utils as hydra_utils

    configure = hydra_utils.configure_log

    def configure_log(*args: Any, **kwargs: Any) -> None:
        try:
            configure(*args, **kwargs)
        except ValueError as error:
            if not isinstance(error.__cause__, ConfigError) or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            say(str(error.__cause__))
            raise SystemExit(1) from None

    hydra_utils.configure_log = configure_log
    try:
        yield
    finally:
        hydra_utils.configure_log = configure


def write_hydra_records_whole() -> None:
    """Hydra's records of a job (`.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`) are written as the runner writes
    its own files (runner.files): whole, and never through a symbolic link planted at their paths (Hydra's open()
    follows one, and overwrote its target with the config); a `.hydra` folder that is a link is refused in one line.

    Set for the process, when runner.cli is imported, not only while main() runs: a parallel launcher's jobs
    (hydra/launcher=joblib) run in processes that import runner.cli to find the job's function and never call main().
    The files' contents are Hydra's own."""
    from hydra.core import utils as hydra_utils

    from runner.files import write_text
    from runner.run_lock import refuse_linked_records

    if getattr(hydra_utils._save_config, "writes_whole", False):
        return

    def _save_config(cfg: Any, filename: str, output_dir: Any) -> None:
        try:
            refuse_linked_records(output_dir)
        except ConfigError as error:
            say(str(error))
            raise SystemExit(1) from None
        write_text(os.path.join(output_dir, filename), OmegaConf.to_yaml(cfg))

    _save_config.writes_whole = True  # type: ignore[attr-defined]
    hydra_utils._save_config = _save_config
