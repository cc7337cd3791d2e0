"""Digits experiment: scikit-learn's bundled 8x8 handwritten digits and a small CNN that classifies them."""

from __future__ import annotations

import math

import torch
from torch import nn

from runner.data import TensorPairDataset

NUM_CLASSES = 10
IMAGE_SIZE = 8
MAX_PIXEL = 16.0  # load_digits stores each pixel as a count of 0..16 set bits of a 4x4 block


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")


def load_digit_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits as images (N, 1, 8, 8) float32 in [0, 1] and int64 labels, from the installed package."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "the digits experiment reads the data set bundled with scikit-learn: pip install scikit-learn"
        ) from error
    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / MAX_PIXEL
    return images, torch.as_tensor(bunch.target, dtype=torch.long)


def stratified_split(labels: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, val), each sorted: every class gives round(val_fraction * its count) to val."""
    generator = torch.Generator().manual_seed(seed)
    val = []
    for label in labels.unique(sorted=True).tolist():
        members = (labels == label).nonzero().flatten()
        shuffled = members[torch.randperm(len(members), generator=generator)]
        val.append(shuffled[: round(val_fraction * len(members))])
    is_val = torch.zeros(len(labels), dtype=torch.bool)
    is_val[torch.cat(val)] = True
    return (~is_val).nonzero().flatten(), is_val.nonzero().flatten()


class DigitsData:
    """A seeded stratified train/validation split of the 1797 digits, held in memory."""

    num_classes = NUM_CLASSES
    image_size = IMAGE_SIZE

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        _require(batch_size >= 1, "batch_size", batch_size, ">= 1")
        _require(0 < val_fraction < 1, "val_fraction", val_fraction, "in (0, 1)")
        _require(num_workers >= 0, "num_workers", num_workers, ">= 0")
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        images, labels = load_digit_arrays()
        train, val = stratified_split(labels, val_fraction, seed)
        # Rounding per class can empty a split at an extreme fraction (each class has ~180 images).
        both = len(train) > 0 and len(val) > 0
        _require(both, "val_fraction", val_fraction, "large and small enough that both splits are non-empty")
        self.train_indices, self.val_indices = train, val
        self.train_dataset = TensorPairDataset(images[train], labels[train])
        self.val_dataset = TensorPairDataset(images[val], labels[val])


def _conv(in_channels: int, out_channels: int) -> list[nn.Module]:
    # GroupNorm, unlike BatchNorm, normalises each sample alone, so results do not depend on how
    # the global batch is split across processes.
    return [
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.GroupNorm(math.gcd(out_channels, 8), out_channels),
        nn.ReLU(inplace=True),
    ]


class DigitsCNN(nn.Module):
    """Two conv stages at 8x8 and 4x4, each ending in a 2x max-pool, then a linear head over the 2x2 map."""

    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 32) -> None:
        super().__init__()
        _require(num_classes >= 2, "num_classes", num_classes, ">= 2")
        _require(width >= 1, "width", width, ">= 1")
        self.features = nn.Sequential(
            *_conv(1, width),
            *_conv(width, width),
            nn.MaxPool2d(2),
            *_conv(width, 2 * width),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * 2 * 2, num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.shape[-3:] != (1, IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"inputs has shape {tuple(inputs.shape)}: must be (batch, 1, 8, 8)")
        return self.head(self.features(inputs).flatten(1))
