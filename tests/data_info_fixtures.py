"""Models and data for the prepare_data/setup, run-info, fast_dev_run and no-decay tests (importable by workers)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from runner.data import TensorPairDataset


class NormNet(nn.Module):
    """Every kind of parameter `optimizer._no_decay_` tells apart: linear weights and biases, LayerNorm, BatchNorm,
    an RMSNorm without a bias, and an embedding-like `pos_embed` parameter."""

    def __init__(self, in_features: int = 8, hidden: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(in_features))
        self.fc1 = nn.Linear(in_features, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.rms = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rms(self.bn(self.ln(torch.relu(self.fc1(x + self.pos_embed))))))


def _pairs(n: int, num_features: int, seed: int) -> TensorPairDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, num_features, generator=generator)
    return TensorPairDataset(x, (x.sum(dim=1) > 0).long())


class CountingDataModule:
    """LightningDataModule-shaped: prepare_data() "downloads" (appends a line to `<folder>/downloads`, then writes the
    data file), setup(stage) reads it in every process (one line per call in `<folder>/setup`)."""

    def __init__(self, folder: str, batch_size: int = 16, num_features: int = 8, num_samples: int = 128) -> None:
        self.folder, self.batch_size = Path(folder), batch_size
        self.num_features, self.num_samples = num_features, num_samples

    def prepare_data(self) -> None:
        with open(self.folder / "downloads", "a") as file:
            file.write(f"{os.getpid()}\n")
        data = _pairs(self.num_samples + 64, self.num_features, seed=0)
        torch.save({"x": data.inputs, "y": data.targets}, self.folder / "data.pt")

    def setup(self, stage: str) -> None:
        with open(self.folder / "setup", "a") as file:
            file.write(f"{os.environ.get('RANK', '0')} {stage}\n")
        saved = torch.load(self.folder / "data.pt", weights_only=True)
        x, y = saved["x"], saved["y"]
        self.train_dataset = TensorPairDataset(x[: self.num_samples], y[: self.num_samples])
        self.val_dataset = TensorPairDataset(x[self.num_samples:], y[self.num_samples:])


class LoaderDataModule(CountingDataModule):
    """The same data through `*_dataloader()` methods, as a LightningDataModule gives it."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.train_set, self.val_set = self.train_dataset, self.val_dataset
        del self.train_dataset, self.val_dataset

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=2 * self.batch_size)


class FailingDownload(CountingDataModule):
    """prepare_data() fails (a download that cannot reach its server)."""

    def prepare_data(self) -> None:
        raise OSError("cannot reach the download server")


class DataHooks:
    """What Lightning's LightningDataModule inherits: loader hooks that raise until a subclass overrides them."""

    def train_dataloader(self) -> DataLoader:
        raise NotImplementedError("`train_dataloader` must be implemented to be used with the Lightning Trainer")

    def val_dataloader(self) -> DataLoader:
        raise NotImplementedError("`val_dataloader` must be implemented to be used with the Lightning Trainer")

    def test_dataloader(self) -> DataLoader:
        raise NotImplementedError("`test_dataloader` must be implemented to be used with the Lightning Trainer")

    def predict_dataloader(self) -> DataLoader:
        raise NotImplementedError("`predict_dataloader` must be implemented to be used with the Lightning Trainer")


class LightningShaped(DataHooks, LoaderDataModule):
    """Overrides train and val only, as most LightningDataModules do: nothing to test after fit."""

    train_dataloader = LoaderDataModule.train_dataloader
    val_dataloader = LoaderDataModule.val_dataloader


class StagedDataModule(CountingDataModule):
    """Makes only what each stage reads, as LightningDataModules often do: train and val for fit, test for test."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        saved = torch.load(self.folder / "data.pt", weights_only=True)
        if stage == "test":
            del self.train_dataset, self.val_dataset
            self.test_dataset = TensorPairDataset(saved["x"][:64], saved["y"][:64])
