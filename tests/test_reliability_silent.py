"""Settings that ran silently wrong: an explicit task.shift_labels the data contradicts, a damaged mlflow_run.json,
a sqlite tracking URI whose folder does not exist."""

from __future__ import annotations

import logging

import pytest
import torch

from lm_fixtures import IGNORE, PaddedSequences
from runner.tasks import LanguageModelTask


def _batch() -> dict[str, torch.Tensor]:
    data = PaddedSequences(num_samples=8, val_samples=1, dict_batches=True)
    return data.collate_fn([data.train_dataset[i] for i in range(8)])


def _said(caplog: pytest.LogCaptureFixture, setting: object, batches: list) -> list[str]:
    task = LanguageModelTask(shift_labels=setting)
    with caplog.at_level(logging.INFO, logger="runner"):
        for batch in batches:
            task.units(batch)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_shift_labels_true_on_targets_already_shifted_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    batch = _batch()
    pre_shifted = (batch["input_ids"][:, :-1], batch["labels"][:, 1:])
    said = _said(caplog, True, [pre_shifted, pre_shifted, pre_shifted])
    assert said == ["task.shift_labels=true, but the first batch's labels are not its input_ids (targets already "
                    "shifted, which auto leaves in place): shifted again, each position is scored against the token "
                    "two on"]


def test_shift_labels_false_on_huggingface_labels_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    batch = _batch()
    unscored = {"input_ids": batch["input_ids"], "labels": torch.full_like(batch["labels"], IGNORE)}
    said = _said(caplog, False, [unscored, batch, batch])  # no evidence in the first: the next one is looked at
    assert said == ["task.shift_labels=false, but the first batch's labels equal its input_ids (the HuggingFace "
                    "convention, which auto shifts by one): in place, each position's label is its own input"]


@pytest.mark.parametrize("setting", [True, False])
def test_shift_labels_the_data_agrees_with_says_nothing(caplog: pytest.LogCaptureFixture, setting: bool) -> None:
    batch = _batch()
    agreeing = batch if setting else (batch["input_ids"][:, :-1], batch["labels"][:, 1:])
    assert _said(caplog, setting, [agreeing, agreeing]) == []
