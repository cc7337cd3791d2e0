"""The built-in data: learnable classification and regression tasks made in memory (no downloads)."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.utils.data import Dataset

from runner.data.batches import TensorPairDataset


def _teacher(num_features: int, outputs: int, generator: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """A fixed random two-layer network (tanh, 4x wide) that labels the synthetic data sets."""
    hidden = 4 * num_features
    w1 = torch.randn(num_features, hidden, generator=generator) / math.sqrt(num_features)
    w2 = torch.randn(hidden, outputs, generator=generator) / math.sqrt(hidden)
    return lambda x: torch.tanh(x @ w1) @ w2


class InputsDataset(Dataset):
    """The inputs of a data set without its targets: what `stage=predict` predicts."""

    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs = inputs

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.inputs[index]


class SyntheticClassification:
    """A learnable task made in memory: Gaussian inputs labelled by a fixed random two-layer teacher.

    `test_samples` > 0 adds a test set (tested after fit, and by stage=test) and its inputs as the predict set.
    """

    def __init__(
        self,
        num_samples: int = 4096,
        val_samples: int = 1000,
        test_samples: int = 0,
        num_features: int = 32,
        num_classes: int = 4,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        for name, value in (("num_samples", num_samples), ("num_features", num_features), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"data.{name}={value} must be a positive integer")
        if num_classes < 2:
            raise ValueError(f"data.num_classes={num_classes} must be at least 2")
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        generator = torch.Generator().manual_seed(seed)
        teacher = _teacher(num_features, num_classes, generator)

        def make(n: int) -> TensorPairDataset:
            x = torch.randn(n, num_features, generator=generator)
            return TensorPairDataset(x, teacher(x).argmax(dim=1))

        self.train_dataset = make(num_samples)
        self.val_dataset = make(val_samples)
        if test_samples > 0:  # drawn after the others, so adding a test set leaves them as they were
            self.test_dataset = make(test_samples)
            self.predict_dataset = InputsDataset(self.test_dataset.inputs)


class SyntheticRegression:
    """A learnable regression task made in memory: targets (N, num_outputs) of a fixed random teacher, plus noise."""

    def __init__(
        self,
        num_samples: int = 4096,
        val_samples: int = 1000,
        num_features: int = 32,
        num_outputs: int = 1,
        noise: float = 0.1,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        for name, value in (("num_samples", num_samples), ("num_features", num_features),
                            ("num_outputs", num_outputs), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"data.{name}={value} must be a positive integer")
        if noise < 0:
            raise ValueError(f"data.noise={noise} must be >= 0")
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        generator = torch.Generator().manual_seed(seed)
        teacher = _teacher(num_features, num_outputs, generator)

        def make(n: int) -> TensorPairDataset:
            x = torch.randn(n, num_features, generator=generator)
            return TensorPairDataset(x, teacher(x) + noise * torch.randn(n, num_outputs, generator=generator))

        self.train_dataset = make(num_samples)
        self.val_dataset = make(val_samples)


