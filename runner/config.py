"""What every layer shares about configs: ConfigError, where the config groups are, the `_target_`s a config names
and the run-folder resolver.

CLI → compose (runner.composition) → validate → run folder → launch → worker → build → loop → teardown; this
module imports none of them.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from hydra.errors import CompactHydraException
from omegaconf import OmegaConf

log = logging.getLogger("runner")


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


# The config groups: the package runner.conf (`pkg://runner.conf` on Hydra's search path), inside a wheel, and
# conf/ at the top of a source checkout (see pyproject.toml's package-dir). The folder is wherever that package is.
CONFIG_MODULE = "runner.conf"
CONFIG_DIR = str(Path(importlib.import_module(CONFIG_MODULE).__file__).resolve().parent)


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


def targets(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Each `_target_` of a config, nested ones and those in lists included: (its key, the dotted name)."""
    if OmegaConf.is_dict(node):
        for key in node:
            if key == "_target_":
                yield prefix + "._target_", node[key]
            else:
                yield from targets(node._get_node(key), f"{prefix}.{key}" if prefix else str(key))
    elif OmegaConf.is_list(node):
        for i, item in enumerate(node):
            yield from targets(item, f"{prefix}[{i}]")


def import_target(target: str) -> Any:
    """The class or function a dotted `_target_` names, its module imported."""
    module_name, _, attr = str(target).rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("unique_dir"):
        # Cached: Hydra copies the cache into each sweep job's config, so a job run elsewhere (a launcher
        # plugin's process) gets the sweep's folder instead of making another.
        OmegaConf.register_new_resolver("unique_dir", unique_dir, use_cache=True)
