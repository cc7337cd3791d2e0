"""`logger=csv`: one metrics.csv per run, a row per step, rewritten from the resumed step on a resume."""

from __future__ import annotations

import csv
import io
import os
from typing import Any, Mapping, Optional

from runner.loggers.base import flat_params


class CSVLogger:
    """One row per log step in `<root_dir>/<filename>`: `step`, then one column per metric name.

    A step's row is written when the next step logs (the training metrics and the validation metrics of one
    step share a row) and at `finalize`. Each row is appended with one write call, so a reader never sees
    half a row; the file is rewritten through a temporary file and a rename only when a new metric adds a
    column. A resumed run drops the rows at or after its resume step, so no step appears twice.
    """

    def __init__(self, root_dir: str, filename: str = "metrics.csv") -> None:
        if not (isinstance(filename, str) and filename and os.sep not in filename and filename not in (".", "..")):
            raise ValueError(f"filename={filename!r} must be a file name inside the run folder, e.g. metrics.csv")
        self.path = os.path.join(root_dir, filename)
        # Lightning's names: the folder, and `experiment` (this logger: its log_metrics writes rows).
        self.save_dir = self.log_dir = root_dir
        self.name: Optional[str] = None
        self.version: Optional[str] = None
        self._params: dict[str, Any] = {}
        self._columns: list[str] = ["step"]
        self._row: Optional[dict[str, Any]] = None  # the step being logged, written when the next one starts
        self._resume_step: Optional[int] = None
        self._fd: Optional[int] = None

    def resume_at(self, step: int) -> None:
        self._resume_step = step

    @property
    def experiment(self) -> "CSVLogger":
        return self

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        """A step's values join its row (`step` None: the row being written, else the last one)."""
        if step is None:
            step = self._row["step"] if self._row is not None else self._last_step()
        if self._row is not None and self._row["step"] != step:
            self._write(self._row)
            self._row = None
        if self._row is None:
            self._row = {"step": step}
        self._row.update(metrics)

    def log_hyperparams(self, params: Any, metrics: Optional[Mapping[str, float]] = None) -> None:
        """The settings are in the run folder's .hydra/; final metrics that no row holds join the last row. The
        user's own calls (without `metrics`) go to hparams.yaml beside metrics.csv, as Lightning's CSVLogger keeps
        them."""
        if metrics is None:
            import yaml

            self._params.update(flat_params(params))
            target = os.path.join(self.log_dir, "hparams.yaml")
            tmp = f"{target}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                yaml.safe_dump(self._params, f, sort_keys=True)
            os.replace(tmp, target)
            return
        unlogged = {k: v for k, v in metrics.items() if k not in self._columns and k not in (self._row or {})}
        if unlogged:
            self.log_metrics(unlogged, self._row["step"] if self._row else self._last_step())

    def finalize(self) -> None:
        if self._row is not None:
            self._write(self._row)
            self._row = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- the file -----------------------------------------------------------------------------------
    def _write(self, row: dict[str, Any]) -> None:
        if self._fd is None:
            row = self._start(row)
        new = [name for name in row if name not in self._columns]
        if new:
            self._rewrite([*self._read_rows(), row], [*self._columns, *new])
        else:
            os.write(self._fd, self._line(row))

    def _start(self, row: dict[str, Any]) -> dict[str, Any]:
        """A new run starts a new file; a resumed one keeps the earlier attempt's rows before its resume step. A
        resumed run's first `row` at the step the earlier attempt stopped at (a validation the stop put off) joins
        that step's row. Returns the row to write."""
        rows: list[dict[str, str]] = []
        if self._resume_step is not None and os.path.exists(self.path):
            reader = csv.DictReader(io.StringIO(_whole_lines(self.path)))
            self._columns = list(reader.fieldnames or ["step"])
            rows = [r for r in reader if _step_of(r) is not None and _step_of(r) < self._resume_step]
        if rows and _step_of(rows[-1]) == row["step"]:
            row = {**{k: v for k, v in rows.pop().items() if v != ""}, **row}
        self._rewrite(rows, self._columns)
        return row

    def _read_rows(self) -> list[dict[str, str]]:
        return [r for r in csv.DictReader(io.StringIO(_whole_lines(self.path))) if _step_of(r) is not None]

    def _rewrite(self, rows: list[dict[str, Any]], columns: list[str]) -> None:
        self._columns = columns
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(self._line({c: c for c in columns}))
            for row in rows:
                f.write(self._line(row))
        os.replace(tmp, self.path)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def _line(self, row: Mapping[str, Any]) -> bytes:
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerow([row.get(c, "") for c in self._columns])
        return buffer.getvalue().encode()

    def _last_step(self) -> int:
        rows = self._read_rows() if os.path.exists(self.path) else []
        return max((_step_of(r) for r in rows), default=0)


def _whole_lines(path: str) -> str:
    """The file without a last line a killed process left half-written (every whole row ends with a newline)."""
    with open(path, newline="") as f:
        text = f.read()
    return text[: text.rfind("\n") + 1]


def _step_of(row: Mapping[str, Any]) -> Optional[int]:
    """The row's step, or None for a row without one."""
    try:
        return int(row.get("step") or "")
    except ValueError:
        return None
