"""Tasks: how a batch becomes the loss to minimise, the units it is averaged over, and metrics (the `task` group)."""

from runner.tasks.base import BatchError, StepWeights, Task, TaskModule
from runner.tasks.model import ModelTask
from runner.tasks.supervised import ClassificationTask, LanguageModelTask, RegressionTask

__all__ = ["BatchError", "ClassificationTask", "LanguageModelTask", "ModelTask", "RegressionTask", "StepWeights",
           "Task", "TaskModule"]
