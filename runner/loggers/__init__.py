"""Loggers: where the metrics the loop reduces on rank 0 go (the `logger` group).

`base` (the four methods every logger has; `NullLogger`, `LoggerSet`), `tensorboard` and `csv_logs` (the built-in
ones), `mlflow` and `wandb` (the trackers, each importing its client only when chosen), and `tracking` (what those
read from the run folder: which job this is, its settings, its saved run id).
"""

from runner.loggers.base import LOGGER_METHODS, LoggerSet, NullLogger
from runner.loggers.csv_logs import CSVLogger
from runner.loggers.tensorboard import EventFile, TensorBoardLogger

__all__ = ["LOGGER_METHODS", "LoggerSet", "NullLogger", "CSVLogger", "EventFile", "TensorBoardLogger"]
