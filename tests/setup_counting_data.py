"""Data that counts how often it is built, prepared and set up, per process (importable by workers).

Each call appends one line `<what> <pid> <rank> [<stage>]` to `<folder>/calls`, with `what` one of `init`,
`prepare_data`, `setup`; `folder` is a constructor argument (processes are separate, so files count them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from runner.data import TensorPairDataset


def _record(folder: str, *words: str) -> None:
    with open(Path(folder) / "calls", "a") as file:
        file.write(" ".join([*words[:1], str(os.getpid()), os.environ.get("RANK", "0"), *words[1:]]) + "\n")


def read_calls(folder: Path) -> list[tuple[str, ...]]:
    """The calls recorded in `folder`, each `(what, pid, rank[, stage])`, in the order they were made."""
    path = Path(folder) / "calls"
    return [tuple(line.split()) for line in path.read_text().splitlines()] if path.exists() else []


def _pairs(n: int, num_features: int) -> TensorPairDataset:
    x = torch.randn(n, num_features, generator=torch.Generator().manual_seed(0))
    return TensorPairDataset(x, (x.sum(dim=1) > 0).long())


class EagerData:
    """Makes its data sets in its constructor (as a data class that tokenises there, an HF `datasets.map`)."""

    def __init__(self, folder: str, batch_size: int = 16, num_features: int = 8, num_samples: int = 128) -> None:
        _record(folder, "init")
        self.batch_size = batch_size
        data = _pairs(num_samples + 64, num_features)
        self.train_dataset = TensorPairDataset(data.inputs[:num_samples], data.targets[:num_samples])
        self.val_dataset = TensorPairDataset(data.inputs[num_samples:], data.targets[num_samples:])


class CountingModule:
    """LightningDataModule-shaped: prepare_data() once per node, setup(stage) makes the data sets.

    `short_rank` with `short_by`: that rank's setup() keeps `short_by` fewer training samples; `rank_batch_size`:
    `short_rank`'s batch_size instead (a setup that depends on the rank, which the runner must refuse).
    """

    def __init__(self, folder: str, batch_size: int = 16, num_features: int = 8, num_samples: int = 128,
                 short_rank: int = -1, short_by: int = 0, rank_batch_size: Optional[int] = None) -> None:
        _record(folder, "init")
        self.folder, self.batch_size = folder, batch_size
        self.num_features, self.num_samples = num_features, num_samples
        self.short_rank, self.short_by, self.rank_batch_size = short_rank, short_by, rank_batch_size

    def prepare_data(self) -> None:
        _record(self.folder, "prepare_data")

    def setup(self, stage: str) -> None:
        _record(self.folder, "setup", stage)
        ours = int(os.environ.get("RANK", "0")) == self.short_rank
        n = self.num_samples - (self.short_by if ours else 0)
        data = _pairs(self.num_samples + 64, self.num_features)
        self.train_dataset = TensorPairDataset(data.inputs[:n], data.targets[:n])
        self.val_dataset = TensorPairDataset(data.inputs[self.num_samples:], data.targets[self.num_samples:])
        if ours and self.rank_batch_size is not None:
            self.batch_size = self.rank_batch_size


class DrawingData(EagerData):
    """EagerData that also draws from torch's global random number generator while it is built."""

    def __init__(self, folder: str, **settings: int) -> None:
        super().__init__(folder, **settings)
        self.noise = torch.randn(1)
