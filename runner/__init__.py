"""runner: a config-driven experiment runner for PyTorch."""

import os
import sys
from importlib.util import module_from_spec, spec_from_file_location
from typing import Any, Sequence

__all__ = ["compose", "fit"]


def _map_checkout_folders() -> None:
    """runner.conf and runner.examples from a source checkout's top-level conf/ and experiments/.

    A wheel carries them inside the package; a checkout keeps them where a Hydra user looks first. Mapped here,
    a checkout runs its own files however it is reached: from its root, on PYTHONPATH, installed or not.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    for name, folder in (("conf", "conf"), ("examples", "experiments")):
        init = os.path.join(os.path.dirname(here), folder, "__init__.py")
        if os.path.isdir(os.path.join(here, name)) or not os.path.isfile(init) or f"{__name__}.{name}" in sys.modules:
            continue
        spec = spec_from_file_location(f"{__name__}.{name}", init, submodule_search_locations=[os.path.dirname(init)])
        module = module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        globals()[name] = module


_map_checkout_folders()


def compose(overrides: Sequence[str] = (), config_dir: Any = None) -> Any:
    """The config `python -m runner <overrides>` would run, for `fit` (and tests) to use from Python.

    `config_dir`: a folder of your own config groups and options (e.g. `model/mynet.yaml`), added to the built-in
    ones as `--config-dir` adds it on the command line: an option of a built-in option's name (`optimizer/adamw.yaml`)
    is the one composed, with a warning naming what it shadows; the primary config stays the runner's. Works inside
    another Hydra app or after `hydra.initialize()`.
    """
    from runner.composition import compose as _compose

    return _compose(overrides, config_dir)


def fit(cfg: Any, run_dir: Any = None) -> dict:
    """Run one job from a composed config (what `python -m runner` calls) and return its final metrics.

    `run_dir` defaults to a new `outputs/YYYY-MM-DD/HH-MM-SS` folder.
    """
    # Imported here so that `import runner` (and `python -m runner --help`) stays cheap.
    from runner.job import fit as _fit

    return _fit(cfg, run_dir=run_dir)
