"""What every logger has: the four methods of `NullLogger` (what ranks other than 0 log to), and `LoggerSet`.

A logger is any class with these four methods; `logger.<name>._target_` names it, and its constructor gets
`root_dir` (the run folder) when it takes one. The loop calls them on global rank 0 (runner.loop).

The built-in loggers have Lightning's surface too, for the user's code (`self.logger` of a LightningModule, a
callback's `loop.logger`): `experiment` (the tracker's own object), `name`, `version`, `save_dir`, `log_dir`,
`log_metrics(metrics, step=None)` and `log_hyperparams(params)`, and the media methods `log_image`,
`log_histogram`, `log_figure` and `log_text` (runner.loggers.media calls them from anywhere in a run).
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any, Callable, Mapping, Optional, Sequence

MEDIA_METHODS = ("log_image", "log_histogram", "log_figure", "log_text")


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class NoExperiment:
    """What `experiment` is where nothing is logged (ranks other than 0, `logger=none`, trainer.fast_dev_run): every
    method of a tracker's object (SummaryWriter.add_image, a W&B run's log, MlflowClient.log_artifact) is taken and
    does nothing, as Lightning's rank-zero-only experiment does."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        # Called only for names the class lacks: any tracker's method, accepted as it would be on rank 0.
        if name.startswith("__"):
            raise AttributeError(name)
        return _nothing

    def __getitem__(self, key: Any) -> "NoExperiment":
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


class NullLogger:
    """What ranks other than 0 (and `logger=none`) log to; its four methods are what every logger has.

    On ranks other than 0 it stands in for a configured logger (`stands_in`): Lightning code sees one per logger
    rank 0 has, with the same folders, whose `experiment` does nothing."""

    def __init__(self, save_dir: Optional[str] = None, log_dir: Optional[str] = None, name: Optional[str] = None,
                 stands_in: bool = False) -> None:
        self.save_dir, self.log_dir, self.name, self.stands_in = save_dir, log_dir, name, stands_in
        self.version: Optional[str] = None

    @property
    def experiment(self) -> NoExperiment:
        return NoExperiment()

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        """The scalars of one step (training metrics at log steps, validation metrics after validation)."""

    def resume_at(self, step: int) -> None:
        """Called before the first log of a resumed run: what an earlier attempt logged at or after `step` is void."""

    def log_hyperparams(self, params: Any, metrics: Optional[Mapping[str, float]] = None) -> None:
        """Once, at the end: the flattened resolved config and the final metrics. The user's own calls (no
        `metrics`) add their params to the run's."""

    def finalize(self) -> None:
        """Once, last, also after a failure: flush and close."""

    def log_image(self, name: str, image: Any, step: int, dataformats: str = "CHW") -> None:
        """An image (a tensor or array, CHW by default; HWC, HW as `dataformats` says) at `step`."""

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        """The distribution of `values` (a tensor or array) at `step`."""

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        """A matplotlib figure at `step` (closed afterwards)."""

    def log_text(self, name: str, text: str, step: int) -> None:
        """A piece of text at `step`."""


LOGGER_METHODS = ("log_metrics", "resume_at", "log_hyperparams", "finalize")


def flat_params(params: Any) -> dict[str, Any]:
    """A user's `log_hyperparams(params)` as flat settings: a dict (nested ones as dotted keys), an
    argparse.Namespace, or an OmegaConf config."""
    from omegaconf import OmegaConf

    from runner.loggers.tracking import flatten

    if isinstance(params, Namespace):
        params = vars(params)
    if OmegaConf.is_config(params):
        params = OmegaConf.to_container(params, resolve=True)
    if not isinstance(params, Mapping):
        raise TypeError(f"log_hyperparams takes a dict, an argparse.Namespace or an OmegaConf config, not "
                        f"{type(params).__name__}")
    return {key: value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
            for key, value in flatten(dict(params)).items()}


class LoggerSet:
    """Several loggers as one: `logger=[tensorboard,csv]`. Each call goes to every logger, in order (a media call
    to those that have the method)."""

    def __init__(self, loggers: Sequence[Any]) -> None:
        self.loggers = list(loggers)

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def resume_at(self, step: int) -> None:
        for logger in self.loggers:
            logger.resume_at(step)

    def log_hyperparams(self, params: Any, metrics: Optional[Mapping[str, float]] = None) -> None:
        for logger in self.loggers:
            logger.log_hyperparams(params, metrics)

    def finalize(self) -> None:
        """Every logger is finalized, even after one fails; the first failure is raised afterwards."""
        errors = []
        for logger in self.loggers:
            try:
                logger.finalize()
            except Exception as error:  # noqa: BLE001 - the others must still close their files
                errors.append(error)
        if errors:
            raise errors[0]

    def log_image(self, name: str, image: Any, step: int, dataformats: str = "CHW") -> None:
        self._media("log_image", name, image, step, dataformats=dataformats)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        self._media("log_histogram", name, values, step)

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        self._media("log_figure", name, figure, step)

    def log_text(self, name: str, text: str, step: int) -> None:
        self._media("log_text", name, text, step)

    def _media(self, method: str, name: str, value: Any, step: int, **settings: Any) -> None:
        for logger in self.loggers:
            getattr(logger, method, _nothing)(name, value, step, **settings)
