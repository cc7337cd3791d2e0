"""Loggers: where the metrics the loop reduces on rank 0 go (the `logger` group).

`base` (the four methods every logger has, and Lightning's surface the built-in ones add; `NullLogger`,
`LoggerSet`), `tensorboard` and `csv_logs` (the built-in ones), `mlflow` and `wandb` (the trackers, each importing
its client only when chosen; `mlflow_store`: MLflow's tracking store), `tracking` (what those read from the run
folder: which job this is, its settings, its saved run id), and `media`: images, histograms, figures and text from
anywhere in a run, to whichever loggers it has (`runner.loggers.log_image(...)`).
"""

from runner.loggers.base import LOGGER_METHODS, LoggerSet, NoExperiment, NullLogger
from runner.loggers.csv_logs import CSVLogger
from runner.loggers.media import log_figure, log_histogram, log_image, log_text
from runner.loggers.tensorboard import EventFile, TensorBoardLogger

__all__ = ["LOGGER_METHODS", "LoggerSet", "NoExperiment", "NullLogger", "CSVLogger", "EventFile", "TensorBoardLogger",
           "log_figure", "log_histogram", "log_image", "log_text"]
