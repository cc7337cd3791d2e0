"""Streams and samplers for the data-order tests (importable by launched workers): the synthetic task's samples
read as an IterableDataset, and a data module whose training loader has a weighted sampler of its own."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, WeightedRandomSampler

from runner.data import SyntheticClassification


class TensorStream(IterableDataset):
    """Pairs of tensors read in order, as a stream: no indexing, and a length only when `sized`."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, sized: bool) -> None:
        self.inputs, self.targets, self.sized = inputs, targets, sized

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(len(self.targets)):
            yield self.inputs[index], self.targets[index]

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("a stream of unknown length")
        return len(self.targets)


class StreamData(SyntheticClassification):
    """The synthetic task's training (and with `val_stream`, validation) samples as streams."""

    def __init__(self, sized: bool = False, val_stream: bool = True, **settings) -> None:
        super().__init__(**settings)
        train, val = self.train_dataset, self.val_dataset
        self.train_dataset = TensorStream(train.inputs, train.targets, sized)
        if val_stream:
            self.val_dataset = TensorStream(val.inputs, val.targets, sized)


class WeightedData(SyntheticClassification):
    """A data module giving a training DataLoader with class-balancing weights (WeightedRandomSampler)."""

    def __init__(self, own_random: bool = False, **settings) -> None:
        super().__init__(**settings)
        self.own_random, self.samples, self.train_dataset = own_random, self.train_dataset, None

    def setup(self, stage: str) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        targets = self.samples.targets
        weights = 1.0 / torch.bincount(targets).double()[targets]
        sampler = UnseededSampler(len(targets)) if self.own_random else WeightedRandomSampler(
            weights, num_samples=len(targets), replacement=True)
        return DataLoader(self.samples, batch_size=self.batch_size, sampler=sampler)


class UnseededSampler(Sampler[int]):
    """A sampler with a random state of its own that no seed reaches."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.state = torch.Generator()
        self.state.seed()

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.size, generator=self.state).tolist())

    def __len__(self) -> int:
        return self.size


class StreamLoaders(SyntheticClassification):
    """A data module whose train_dataloader() is a DataLoader over a stream (torch gives it a placeholder sampler)."""

    def __init__(self, **settings) -> None:
        super().__init__(**settings)
        self.samples, self.train_dataset = self.train_dataset, None

    def setup(self, stage: str) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        stream = TensorStream(self.samples.inputs, self.samples.targets, sized=False)
        return DataLoader(stream, batch_size=self.batch_size, num_workers=self.num_workers)


class PositionedStream(TensorStream):
    """A stream with a position of its own (state_dict/load_state_dict, as HuggingFace's IterableDataset has)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        super().__init__(inputs, targets, sized=False)
        self.position = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self.position = self.position, 0
        for index in range(start, len(self.targets)):
            self.position = index + 1
            yield self.inputs[index], self.targets[index]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class PositionedData(SyntheticClassification):
    def __init__(self, **settings) -> None:
        super().__init__(**settings)
        self.train_dataset = PositionedStream(self.train_dataset.inputs, self.train_dataset.targets)
