"""runner: a config-driven experiment runner for PyTorch."""

from typing import Any, Sequence

__all__ = ["compose", "fit"]


def compose(overrides: Sequence[str] = (), config_dir: Any = None) -> Any:
    """The config `python -m runner <overrides>` would run, for `fit` (and tests) to use from Python.

    `config_dir`: a folder of your own config groups and options (e.g. `model/mynet.yaml`), added to the built-in
    ones as `--config-dir` adds it on the command line. Works inside another Hydra app or after `hydra.initialize()`.
    """
    from runner.config import compose as _compose

    return _compose(overrides, config_dir)


def fit(cfg: Any, run_dir: Any = None) -> dict:
    """Run one job from a composed config (what `python -m runner` calls) and return its final metrics.

    `run_dir` defaults to a new `outputs/YYYY-MM-DD/HH-MM-SS` folder.
    """
    # Imported here so that `import runner` (and `python -m runner --help`) stays cheap.
    from runner.job import fit as _fit

    return _fit(cfg, run_dir=run_dir)
