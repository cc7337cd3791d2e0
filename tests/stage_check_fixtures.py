"""Data and models for tests/test_stage_check.py: streams as users bring them (an iterable without indexing, a
DataLoader over a stream from train_dataloader(), a HuggingFace `datasets` stream), a model that breaks on batches of
more than 4 samples, and a model with a net given as a nested `_target_` node."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from runner.data import SyntheticClassification
from runner.models import MLP
from stream_data import TensorStream


class PlainIterable:
    """Samples from `__iter__` alone: no IterableDataset, no indexing, no length."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return zip(self.inputs, self.targets)


class IterableData(SyntheticClassification):
    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.train_dataset = PlainIterable(self.train_dataset.inputs, self.train_dataset.targets)


class StreamLoaderData(SyntheticClassification):
    """train_dataloader(): a DataLoader over a stream (no setup: built as it is by stage=check)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.samples, self.train_dataset = self.train_dataset, None

    def train_dataloader(self) -> DataLoader:
        stream = TensorStream(self.samples.inputs, self.samples.targets, sized=False)
        return DataLoader(stream, batch_size=self.batch_size)


class HFStreamData(SyntheticClassification):
    """The training samples as a HuggingFace `datasets` stream of dicts ({"x", "labels"}), as torch tensors."""

    def __init__(self, **settings: Any) -> None:
        import datasets

        super().__init__(**settings)
        inputs, targets = self.train_dataset.inputs, self.train_dataset.targets

        def samples() -> Iterator[dict]:
            for x, y in zip(inputs.tolist(), targets.tolist()):
                yield {"x": x, "labels": y}
        self.train_dataset = datasets.IterableDataset.from_generator(samples).with_format("torch")


class ShortStream(SyntheticClassification):
    """A stream of 3 samples: fewer than one batch, so an epoch would train nothing."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.train_dataset = TensorStream(self.train_dataset.inputs[:3], self.train_dataset.targets[:3], sized=False)


class AtMostFour(MLP):
    """An MLP whose output adds a per-row offset of 4 rows: batches of up to 4 samples pass, larger ones fail."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.register_buffer("offsets", torch.zeros(4, settings.get("num_classes", 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        return logits + self.offsets[: len(x)]


class WithNet(nn.Module):
    """A model holding a net it is given: `net` is a nested `_target_` node of the model's config."""

    def __init__(self, net: nn.Module, scale: float = 1.0) -> None:
        super().__init__()
        self.net, self.scale = net, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale
