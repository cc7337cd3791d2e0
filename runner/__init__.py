"""runner: a config-driven experiment runner for PyTorch."""

from typing import Any

__all__ = ["fit"]


def fit(cfg: Any, run_dir: Any = None) -> dict:
    """Run one job from a composed config (what `python -m runner` calls) and return its final metrics."""
    # Imported here so that `import runner` (and `python -m runner --help`) stays cheap.
    from runner.job import fit as _fit

    return _fit(cfg, run_dir=run_dir)
