"""A LightningModule's training_step and validation_step on one batch (stage=check), as a worker runs them at its first
step and its first validation: the trainer view attached, setup("fit") and configure_model() run first, `self.log`
taken by the runner's recorder. The module is the check's own build, on the CPU; nothing of it is kept."""

from __future__ import annotations

from typing import Any, Optional

import torch

from runner.lightning.attach import setup_module
from runner.lightning.detect import overrides
from runner.lightning.manual import is_manual
from runner.lightning.record import Evaluation, LogRecorder
from runner.lightning.task import _loss
from runner.lightning.trainer_view import TrainerView
from runner.tasks.base import leading_size


class StepFailed(Exception):
    """The user's `step` raised `error` (or returned what the runner cannot train on)."""

    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(f"{step}: {error}")
        self.step, self.error = step, error


class NotTried(Exception):
    """The steps could not be reached for a reason a worker would not have (a setup() reading what a check lacks)."""


def run_steps(model: Any, cfg: Any, train_batch: Any, val_batch: Optional[Any]) -> tuple[Optional[int], list[str]]:
    """training_step (forward and backward) on `train_batch`, then validation_step on `val_batch` (None: not run);
    returns training_step's FLOPs (None under manual optimization, whose step is not run: it steps optimizers only a
    worker has) and the steps that ran. Raises StepFailed naming the step that failed."""
    from torch.utils.flop_counter import FlopCounterMode

    view = TrainerView(cfg)
    try:
        setup_module(model, view)
    except Exception as error:  # noqa: BLE001 - the worker runs setup with its data and processes, and says why
        raise NotTried(f"the module's setup(\"fit\") or configure_model() fails without a worker's trainer: "
                       f"{type(error).__name__}: {error}") from error
    recorder = LogRecorder()
    model.log, model.log_dict = recorder.log, recorder.log_dict  # as the worker binds them (runner.lightning.attach)
    ran, flops = [], None
    if not is_manual(model):
        model.train()
        with FlopCounterMode(display=False) as counter, recorder.recording("train", "training_step"):
            try:
                loss = _loss(model.training_step(train_batch, 0), "training_step", optional=True)
                if loss is not None and loss.requires_grad:
                    loss.backward()
            except Exception as error:  # noqa: BLE001 - whatever the user's step raises is its failure
                raise StepFailed("training_step", error) from error
        flops, ran = counter.get_total_flops(), ["training_step"]
    if val_batch is not None and overrides(model, "validation_step"):
        model.eval()
        with torch.no_grad(), recorder.recording("val", "validation_step") as logged:
            try:
                model.validation_step(val_batch, 0)
                Evaluation(torch.device("cpu")).add(logged, leading_size(val_batch), model)
            except Exception as error:  # noqa: BLE001
                raise StepFailed("validation_step", error) from error
        ran.append("validation_step")
    return flops, ran
