"""What a batch is: samples collated by torch's default, or a batch a data set fetched whole (`__getitems__`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate


class Batch(tuple):
    """A batch a data set already collated itself (from `__getitems__`); the loader passes it through."""


def collate(samples: Any) -> Any:
    return samples if isinstance(samples, Batch) else default_collate(samples)


class TensorPairDataset(Dataset):
    """In-memory (inputs, targets) pairs that fetch a whole batch with one indexing operation."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def __getitems__(self, indices: list[int]) -> Batch:
        index = torch.as_tensor(indices)
        return Batch((self.inputs[index], self.targets[index]))


