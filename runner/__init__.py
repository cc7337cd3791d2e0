"""runner: a config-driven experiment runner for PyTorch."""

from typing import Any, Sequence

__all__ = ["compose", "fit"]


def compose(overrides: Sequence[str] = (), config_dir: Any = None) -> Any:
    """The config `python -m runner <overrides>` would run, for `fit` (and tests) to use from Python.

    `config_dir` defaults to the project's conf/; give another folder with the same groups to use your own.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from runner.cli import CONFIG_DIR  # registers the schema and resolvers

    with initialize_config_dir(config_dir=str(config_dir or CONFIG_DIR), version_base="1.3", job_name="runner"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def fit(cfg: Any, run_dir: Any = None) -> dict:
    """Run one job from a composed config (what `python -m runner` calls) and return its final metrics.

    `run_dir` defaults to a new `outputs/YYYY-MM-DD/HH-MM-SS` folder.
    """
    # Imported here so that `import runner` (and `python -m runner --help`) stays cheap.
    from runner.job import fit as _fit

    return _fit(cfg, run_dir=run_dir)
