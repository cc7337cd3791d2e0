"""The config's shape: overrides Hydra fails on, required groups removed, keys no schema has, settings of
callbacks that are not selected, Lightning's Trainer, loggers and callbacks where the runner's own go.

CLI → [compose: these checks] → validate → run folder → launch → worker → build → loop → teardown. What
`runner.composition.compose` runs (and `validate` first): no imports of targets, no hardware. It reads the schemas and
the built-in groups' folder it is given, never runner.config, which calls it.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from runner.lightning.stock import lightning_classes
from runner.schemas import RunnerConfig, TrainerConfig
from runner.values import named_optimizers, show, suggest

# Groups every run needs: `~group` or `group=null` would remove one.
REQUIRED_GROUPS = ("strategy", "accelerator", "precision", "checkpoint_io", "cluster", "model", "data",
                   "optimizer", "scheduler", "task")


def group_options(group: str, groups_dir: str) -> list[str]:
    """The options of `group` in the built-in config groups' folder (runner.config.CONFIG_DIR)."""
    folder = Path(groups_dir) / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def not_an_option(group: str, value: str, options: list[str], advice: str = "") -> str:
    """The one line for a value a config group has no option for, whatever the group (a new one gets it as is):
    `optimizer=lion is not an option of optimizer: adamw, parts, sgd`, with the closest option and any `advice`."""
    close = suggest(value, options)
    said = "; ".join(filter(None, [close.strip(" ()"), advice]))
    return f"{group}={value} is not an option of {group}: {', '.join(options)}{f' ({said})' if said else ''}"


def _field_names(schema: Any) -> list[str]:
    return [f.name for f in fields(schema)]


def _check_groups_set(cfg: DictConfig, groups_dir: str) -> Iterator[str]:
    for group in REQUIRED_GROUPS:
        node = cfg.get(group)
        if node is None:
            hint = "; scheduler=constant keeps the learning rate constant" if group == "scheduler" else ""
            yield (f"{group} is not set ({group}=null and ~{group} remove the group): choose {group}=<option> "
                   f"({', '.join(group_options(group, groups_dir))}){hint}")
        elif not (OmegaConf.is_dict(node) and "_target_" in node) and not (group == "optimizer"
                                                                         and named_optimizers(node)):
            yield (f"{group}={show(node)} has no _target_: choose {group}=<option> "
                   f"({', '.join(group_options(group, groups_dir))})")


def _check_keys(cfg: DictConfig, groups_dir: str) -> Iterator[str]:
    """Keys the schemas do not have, which Hydra's `+key=value` adds without a word (and nothing would read)."""
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
        options = group_options(str(key), groups_dir) if key in top else []
        if options:
            hint = f" ({key} is a config group: {key}=<option>, one of {', '.join(options)})"
        else:
            hint = suggest(str(key), trainer)
        yield f"trainer.{key} is not a trainer setting{hint}; allowed: {', '.join(trainer)}"


def check_overrides(overrides: Sequence[str], groups_dir: str) -> list[str]:
    """`group=null` on the command line, which Hydra fails on with a traceback; `~group` is its syntax."""
    problems = []
    for override in overrides:
        key, sep, value = override.partition("=")
        group = key.lstrip("+~")
        options = group_options(group, groups_dir) if sep and value.strip() == "null" else []
        if options:
            hint = "logger=none logs nothing; " if group == "logger" else ""
            problems.append(not_an_option(group, "null", options, f"{hint}~{group} removes the group"))
    return problems


def drop_unselected_callbacks(cfg: DictConfig, groups_dir: str) -> list[str]:
    """Remove what a config sets for callbacks it does not select, and return their keys.

    An experiment may tune `callbacks.early_stopping.patience`; `callbacks=none` or `callbacks=[model_summary]`
    over it leaves that entry without the option's `_target_`: a callback turned off, not one to build. Only an
    option of the callbacks group is taken so: any other entry without a `_target_` (a misspelt name) stays, for
    the checks to name.
    """
    node = cfg.get("callbacks")
    if not OmegaConf.is_dict(node):
        return []
    options = group_options("callbacks", groups_dir)
    unselected = [str(name) for name, spec in node.items()
                  if name in options and OmegaConf.is_dict(spec) and "_target_" not in spec]
    keys = [key for name in unselected
            for key in [f"callbacks.{name}.{setting}" for setting in node[name]] or [f"callbacks.{name}"]]
    with open_dict(node):
        for name in unselected:
            del node[name]
    return keys


def check_keys(cfg: DictConfig, groups_dir: str) -> list[str]:
    """Problems of the config's shape: removed groups, keys nothing reads and Lightning's own classes. No imports,
    no hardware."""
    keys = list(_check_keys(cfg, groups_dir))
    groups = list(_check_groups_set(cfg, groups_dir))
    return [*groups, *keys, *lightning_classes(OmegaConf.to_container(cfg, resolve=False))]
