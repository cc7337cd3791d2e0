"""Whether a batch's labels are its input tokens (scored one position on, the HuggingFace convention) or next tokens.

HuggingFace's collators and causal LM heads take `labels = input_ids` (padding marked `ignore_index`) and shift
inside the model: the logits at position t are scored against the label at t + 1. Data made for the runner's own
`task=language_model` holds targets already shifted. Both are (B, T) integer tensors; only their values tell them
apart, so `auto` looks once: labels equal to the input ids wherever they are not ignored are the HuggingFace
convention (next-token targets equal their inputs only where a token repeats).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Literal, Optional, Union

import torch

from runner.tasks.base import as_mapping

ShiftSetting = Union[Literal["auto"], bool]


def check_setting(value: Any) -> ShiftSetting:
    """`task.shift_labels`: auto, true or false (a ValueError naming the key otherwise)."""
    if not (isinstance(value, bool) or (isinstance(value, str) and value == "auto")):
        raise ValueError(f"task.shift_labels={value!r} is not allowed: use auto (shift when the labels equal "
                         "input_ids, the HuggingFace convention), true or false")
    return value


def _contradicted(setting: bool) -> None:
    """One warning for the job (every rank sees such a batch; rank 0 says it, the others note it in their logs)."""
    said = ("the first batch's labels are not its input_ids (targets already shifted, which auto leaves in "
            "place): shifted again, each position is scored against the token two on" if setting else
            "the first batch's labels equal its input_ids (the HuggingFace convention, which auto shifts by one): "
            "in place, each position's label is its own input")
    # The task is built without a rank; RANK is set in every worker, as under torchrun.
    level = logging.WARNING if os.environ.get("RANK", "0") == "0" else logging.INFO
    logging.getLogger("runner").log(level, "task.shift_labels=%s, but %s", str(setting).lower(), said)


def input_ids(inputs: Any) -> Optional[torch.Tensor]:
    """The token ids the model reads: the inputs themselves (a tensor) or their `input_ids` (dict-like)."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    fields = as_mapping(inputs)
    found = fields.get("input_ids") if isinstance(fields, Mapping) else None
    return found if isinstance(found, torch.Tensor) else None


class LabelShift:
    """`task.shift_labels`: True or False as set, or (auto) decided by the first batch holding a label.

    `does(inputs, labels)` says whether labels[:, t + 1] is the target of position t. The decision is taken once
    (one comparison on the device, then fixed for the run) and said once in the log. A setting given explicitly is
    compared with what auto would decide, once: a first batch that contradicts it is one warning (true on targets
    already shifted scores each position against the token two on; false on HuggingFace labels learns to copy).
    """

    def __init__(self, setting: Any, ignore_index: int, what: str) -> None:
        self.ignore_index, self.what = ignore_index, what
        self.decided: Optional[bool] = None if check_setting(setting) == "auto" else bool(setting)
        self._compared = self.decided is None  # auto has nothing to compare with

    def does(self, inputs: Any, labels: torch.Tensor) -> bool:
        if self.decided is None:
            found = self._look(inputs, labels)
            if found is None:
                return False  # no evidence yet
            self.decided = found
            logging.getLogger("runner").info(
                "task.shift_labels=auto: %s", f"the labels equal input_ids (the HuggingFace convention): {self.what}"
                if found else "the labels are not the input_ids: they are taken as next-token targets, "
                "scored position by position (task.shift_labels=true shifts them)")
        elif not self._compared:
            found = self._look(inputs, labels)
            if found is not None:
                self._compared = True
                if found != self.decided:
                    _contradicted(self.decided)
        return self.decided

    def _look(self, inputs: Any, labels: torch.Tensor) -> Optional[bool]:
        """Whether the labels equal the input ids wherever scored; None without evidence (no value, no label)."""
        if labels.device.type == "meta":
            return None  # a trial on the meta device (shapes, FLOPs) has no values to look at
        kept = labels != self.ignore_index
        if not bool(kept.any()):
            return None  # nothing scored in this batch: no evidence either way
        ids = input_ids(inputs)
        return bool(ids is not None and ids.shape == labels.shape and bool(((ids == labels) | ~kept).all()))

    @staticmethod
    def shifted(labels: torch.Tensor) -> torch.Tensor:
        """The labels that remain scored once position t takes label t + 1."""
        return labels[:, 1:]
