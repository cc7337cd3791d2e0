"""Data and models that cannot train, named by `data._target_=trust_data.<Name>` / `model._target_=...` in tests.

Each takes (and ignores) the other keys of the built-in option it replaces, so one override swaps it in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Samples(torch.utils.data.Dataset):
    def __init__(self, make: Any, size: int = 16) -> None:
        self.make, self.size = make, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        return self.make(index)


class NoneSamples:
    """A data set whose samples are all None (a `__getitem__` that forgot its return)."""

    def __init__(self, batch_size: int = 4, **ignored: Any) -> None:
        self.batch_size = batch_size
        self.train_dataset = _Samples(lambda i: None)
        self.val_dataset = _Samples(lambda i: None)


class RaggedSamples:
    """Inputs of 3 + i % 2 features: the default collate cannot stack the first two."""

    def __init__(self, batch_size: int = 4, **ignored: Any) -> None:
        self.batch_size = batch_size
        self.train_dataset = _Samples(lambda i: (torch.zeros(3 + i % 2), torch.tensor(0)))
        self.val_dataset = None


class RaggedValidation:
    """Training samples that stack; validation samples that do not."""

    def __init__(self, batch_size: int = 4, num_features: int = 8, **ignored: Any) -> None:
        self.batch_size = batch_size
        self.train_dataset = _Samples(lambda i: (torch.zeros(num_features), torch.tensor(i % 2)))
        self.val_dataset = _Samples(lambda i: (torch.zeros(num_features + i % 2), torch.tensor(0)))


class RaggedWithCollate(RaggedSamples):
    """Ragged samples with a collate_fn that pads them: a batch forms."""

    @staticmethod
    def collate_fn(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = nn.utils.rnn.pad_sequence([x for x, _ in samples], batch_first=True)[:, :3]
        return inputs, torch.stack([y for _, y in samples])


class FrozenModel(nn.Module):
    """A linear classifier whose parameters all have requires_grad=False."""

    def __init__(self, in_features: int = 8, num_classes: int = 4, **ignored: Any) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class NoParameters(nn.Module):
    """A model without parameters: fixed scores from the first features."""

    def __init__(self, num_classes: int = 4, **ignored: Any) -> None:
        super().__init__()
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : self.num_classes]
