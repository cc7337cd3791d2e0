"""Whether a batch's labels are its input tokens (scored one position on, the HuggingFace convention) or next tokens.

HuggingFace's collators and causal LM heads take `labels = input_ids` (padding marked `ignore_index`) and shift
inside the model: the logits at position t are scored against the label at t + 1. Data made for the runner's own
`task=language_model` holds targets already shifted. Both are (B, T) integer tensors; only their values tell them
apart, so `auto` looks once: labels equal to the input ids wherever they are not ignored are the HuggingFace
convention (next-token targets equal their inputs only where a token repeats).
"""

from __future__ import annotations

import logging
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
    (one comparison on the device, then fixed for the run) and said once in the log.
    """

    def __init__(self, setting: Any, ignore_index: int, what: str) -> None:
        self.ignore_index, self.what = ignore_index, what
        self.decided: Optional[bool] = None if check_setting(setting) == "auto" else bool(setting)

    def does(self, inputs: Any, labels: torch.Tensor) -> bool:
        if self.decided is None:
            if labels.device.type == "meta":
                return False  # a trial on the meta device (shapes, FLOPs) has no values to look at
            kept = labels != self.ignore_index
            if not bool(kept.any()):
                return False  # nothing scored in this batch: no evidence either way, and no token to count
            ids = input_ids(inputs)
            self.decided = bool(ids is not None and ids.shape == labels.shape
                                and bool(((ids == labels) | ~kept).all()))
            logging.getLogger("runner").info(
                "task.shift_labels=auto: %s", f"the labels equal input_ids (the HuggingFace convention): {self.what}"
                if self.decided else "the labels are not the input_ids: they are taken as next-token targets, "
                "scored position by position (task.shift_labels=true shifts them)")
        return self.decided

    @staticmethod
    def shifted(labels: torch.Tensor) -> torch.Tensor:
        """The labels that remain scored once position t takes label t + 1."""
        return labels[:, 1:]
