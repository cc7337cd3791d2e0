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


def run_steps(model: Any, cfg: Any, train_batch: Any,
              val_batch: Optional[Any]) -> tuple[Optional[int], list[str], Optional[set[str]]]:
    """training_step (forward and backward) on `train_batch`, then validation_step on `val_batch` (None: not run)
    and on_validation_epoch_end; returns training_step's FLOPs (None under manual optimization, whose step is not
    run: it steps optimizers only a worker has), the steps that ran, and the names they logged at validation (None
    where that is not known: no validation ran, or on_validation_epoch_end failed without a worker's run). Raises
    StepFailed naming the step that failed."""
    from torch.utils.flop_counter import FlopCounterMode

    view = TrainerView(cfg)
    try:
        setup_module(model, view)
    except Exception as error:  # noqa: BLE001 - the worker runs setup with its data and processes, and says why
        raise NotTried(f"the module's setup(\"fit\") or configure_model() fails without a worker's trainer: "
                       f"{type(error).__name__}: {error}") from error
    recorder = LogRecorder()
    model.log, model.log_dict = recorder.log, recorder.log_dict  # as the worker binds them (runner.lightning.attach)
    ran, flops, val_names = [], None, None
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
            val_names = set(logged)
        ran.append("validation_step")
        val_names = _epoch_end_names(model, recorder, val_names)
    return flops, ran, val_names


def _epoch_end_names(model: Any, recorder: LogRecorder, names: set[str]) -> Optional[set[str]]:
    """`names` and what on_validation_epoch_end logs after one batch (a metric computed over the epoch); None where
    it fails: over one batch, without a worker's run, that is no failure of the module."""
    if not overrides(model, "on_validation_epoch_end"):
        return names
    with torch.no_grad(), recorder.recording("val", "on_validation_epoch_end") as logged:
        try:
            model.on_validation_epoch_end()
        except Exception:  # noqa: BLE001 - the worker's run says what fails there
            return None
    return names | set(logged)
