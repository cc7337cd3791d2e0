"""What every logger has: the four methods of `NullLogger` (what ranks other than 0 log to), and `LoggerSet`.

A logger is any class with these four methods; `logger.<name>._target_` names it, and its constructor gets
`root_dir` (the run folder) when it takes one. The loop calls them on global rank 0 (runner.loop).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


class NullLogger:
    """What ranks other than 0 (and `logger=none`) log to; its four methods are what every logger has."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """The scalars of one step (training metrics at log steps, validation metrics after validation)."""

    def resume_at(self, step: int) -> None:
        """Called before the first log of a resumed run: what an earlier attempt logged at or after `step` is void."""

    def log_hyperparams(self, params: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        """Once, at the end: the flattened resolved config and the final metrics."""

    def finalize(self) -> None:
        """Once, last, also after a failure: flush and close."""


LOGGER_METHODS = ("log_metrics", "resume_at", "log_hyperparams", "finalize")


class LoggerSet:
    """Several loggers as one: `logger=[tensorboard,csv]`. Each call goes to every logger, in order."""

    def __init__(self, loggers: Sequence[Any]) -> None:
        self.loggers = list(loggers)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def resume_at(self, step: int) -> None:
        for logger in self.loggers:
            logger.resume_at(step)

    def log_hyperparams(self, params: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
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
