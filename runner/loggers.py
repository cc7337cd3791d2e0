"""Metric loggers: TensorBoard for global rank 0, a logger that does nothing for the other ranks."""

from __future__ import annotations

import os
from typing import Any, Mapping


class NullLogger:
    """What ranks other than 0 log to."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def resume_at(self, step: int) -> None:
        pass

    def log_hyperparams(self, params: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        pass

    def finalize(self) -> None:
        pass


def _hparam_value(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) else str(value)


class TensorBoardLogger:
    """One event stream in `<root_dir>/<subdir>`, with the hyperparameters and final metrics for HParams."""

    def __init__(self, root_dir: str, subdir: str = "tensorboard", flush_secs: int = 30) -> None:
        self.log_dir = os.path.join(root_dir, subdir)
        self.flush_secs = flush_secs
        self._writer: Any = None
        self._purge_step: Any = None
        self._last_step = 0
        self._logged: set[str] = set()

    @property
    def writer(self) -> Any:
        if self._writer is None:  # tensorboard is imported by the first write, not at start-up
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir, flush_secs=self.flush_secs, purge_step=self._purge_step)
        return self._writer

    def resume_at(self, step: int) -> None:
        """A resumed run: TensorBoard drops events at or after `step` that an earlier attempt wrote."""
        self._purge_step = step

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """All of a step's scalars as one event: one write, not one per metric."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
        self.writer._get_file_writer().add_summary(Summary(value=values), global_step=step)
        self._logged.update(metrics)
        self._last_step = max(self._last_step, step)

    def log_hyperparams(self, params: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        """Write HParams into the same event file (SummaryWriter.add_hparams would open a second one)."""
        from torch.utils.tensorboard.summary import hparams

        flat = {k: _hparam_value(v) for k, v in params.items()}
        experiment, session_start, session_end = hparams(flat, dict(metrics))
        file_writer = self.writer._get_file_writer()
        for summary in (experiment, session_start, session_end):
            file_writer.add_summary(summary)
        # HParams reads each metric from the scalar series of that name. Series already logged end with
        # the final value; writing it again at step 0 would draw a line back to the start.
        for name, value in metrics.items():
            if name not in self._logged:
                self.writer.add_scalar(name, value, global_step=self._last_step)

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.close()
