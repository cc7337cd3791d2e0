"""Config tests for a user's pytest: every experiment and option of a config folder checked as `python -m runner
stage=check` checks it, one parametrised test per config (what lightning-hydra-template's tests/test_configs.py
does by composing alone). In a test file, with `my_conf` the folder given to `--config-dir`:

    import pytest

    from runner.testing import check_config, config_cases


    @pytest.mark.parametrize("overrides", config_cases("my_conf"))
    def test_config(overrides):
        check_config(overrides, config_dir="my_conf")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from runner.config import CONFIG_DIR

# Presets of a sweeper plugin (a search, not a config) and Hydra's own groups are not checked.
_SKIPPED_GROUPS = ("hparams_search", "hydra")
# Groups whose options are made for one another: a model for its data's shapes, a task for its batches. One of them
# over the runner's default others (an image model on the built-in vectors) fails without being wrong; the
# experiments that choose them check them together.
PAIRED_GROUPS = ("model", "data", "task")


def config_cases(config_dir: Any = None, groups: Optional[Sequence[str]] = None) -> list[Any]:
    """One list of overrides per config to check, each a `pytest.param` with a readable id (`experiment=mine`,
    `optimizer=mine`): every experiment of `config_dir`, then every option of its other groups over the defaults,
    except the model, data and task options (PAIRED_GROUPS), which the experiments check together.

    `groups`: these groups' options, each alone over the defaults (e.g. ["experiment"], or ["model"] where the
    models take the default data). Without `config_dir`: the runner's own experiments.
    """
    import pytest

    folder = Path(config_dir) if config_dir is not None else Path(CONFIG_DIR)
    if config_dir is None and groups is None:
        groups = ["experiment"]
    if not folder.is_dir():
        raise FileNotFoundError(f"config_dir={config_dir} is not a folder")
    chosen = (lambda name: name in groups) if groups is not None else (lambda name: name not in PAIRED_GROUPS)
    cases = [f"{group_dir.name}={option.stem}"
             for group_dir in folder.iterdir() if group_dir.is_dir() and group_dir.name not in _SKIPPED_GROUPS
             and chosen(group_dir.name) for option in group_dir.glob("*.yaml")]
    cases.sort(key=lambda case: (not case.startswith("experiment="), case))
    return [pytest.param([case], id=case) for case in cases]


def check_config(overrides: Sequence[str] = (), config_dir: Any = None, stage: str = "check") -> dict:
    """Compose `overrides` (with `config_dir`'s groups) and check them as `python -m runner stage=check` does; raise
    the ConfigError that lists every problem, else return what the check learned (parameters, FLOPs per sample,
    bytes per process; see runner.checks.dry_run). `stage="check_data"` also sets up a data module."""
    from runner.composition import compose
    from runner.job import check

    cfg = compose([*overrides, f"stage={stage}"], config_dir=config_dir)
    return check(cfg)
