"""Data: the built-in synthetic task, and the samplers and loaders that give every step its global batch."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torch.utils.data._utils.collate import default_collate


class Batch(tuple):
    """A batch a data set already collated itself (from `__getitems__`); the loader passes it through."""


def collate(samples: Any) -> Any:
    return samples if isinstance(samples, Batch) else default_collate(samples)


# Samples a check collates, at most: enough to meet differing shapes, few enough to read in microseconds.
FIRST_SAMPLES = 4


def first_batch_problem(data: Any, split: str) -> Optional[str]:
    """Why the first samples of `data.<split>_dataset` do not form a batch as the loader forms it, or None."""
    dataset = getattr(data, f"{split}_dataset", None)
    if dataset is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return None
    indices = list(range(min(FIRST_SAMPLES, data.batch_size, len(dataset))))
    custom = getattr(data, "collate_fn", None)
    try:  # as the loader fetches: the whole batch at once where the data set can
        samples = dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]
    except Exception as error:  # noqa: BLE001 - any failure to read a sample is the data's to fix
        return f"reading samples {indices} of {split}_dataset fails: {_first_line(error)}"
    try:
        (custom or collate)(samples)
    except Exception as error:  # noqa: BLE001
        how, fix = (("its collate_fn", "fix data.collate_fn") if custom is not None
                    else ("the default collate", "give the data a collate_fn that batches them"))
        return (f"the first {len(indices)} samples of {split}_dataset do not form a batch with {how}: "
                f"{_first_line(error)}; {fix}")
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


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


class TrainSampler(DistributedSampler):
    """DistributedSampler that drops the tail and can start mid-epoch.

    With `drop_last`, rank r of W takes positions r, r+W, ... of the epoch's permutation, so the
    global batch of step t is the same set of samples for any W at a fixed global batch size.
    `start_batch` skips the batches a resumed run already trained on in this epoch.
    """

    def __init__(self, dataset: Dataset, batch_size: int, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self.start_batch = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start_batch * self.batch_size :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start_batch * self.batch_size)


class EvalSampler(Sampler[int]):
    """Rank r of W takes samples r, r+W, ...: every sample exactly once, no padding, in order."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        self.size, self.num_replicas, self.rank = len(dataset), num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.num_replicas))


def _loader(data: Any, dataset: Dataset, sampler: Sampler, drop_last: bool, seed: int) -> DataLoader:
    workers = int(getattr(data, "num_workers", 0))
    return DataLoader(
        dataset,
        batch_size=data.batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=workers,
        # Pinned memory only speeds up copies to a GPU; without one torch warns and ignores it.
        pin_memory=bool(getattr(data, "pin_memory", False)) and torch.cuda.is_available(),
        persistent_workers=workers > 0,
        collate_fn=getattr(data, "collate_fn", collate),
        # The loader's own generator keeps the global RNG untouched, so resuming mid-epoch is exact.
        generator=torch.Generator().manual_seed(seed),
    )


def train_loader(data: Any, sampler_kwargs: Optional[dict], seed: int) -> DataLoader:
    kwargs = sampler_kwargs or {"num_replicas": 1, "rank": 0}
    sampler = TrainSampler(data.train_dataset, data.batch_size, seed=seed, **kwargs)
    return _loader(data, data.train_dataset, sampler, drop_last=True, seed=seed)


def val_loader(data: Any, sampler_kwargs: Optional[dict], seed: int, split: str = "val") -> Optional[DataLoader]:
    """The loader of `<split>_dataset` (val, test or predict): every sample once over the processes, in order."""
    dataset = getattr(data, f"{split}_dataset", None)
    if dataset is None or len(dataset) == 0:
        return None
    kwargs = sampler_kwargs or {"num_replicas": 1, "rank": 0}
    return _loader(data, dataset, EvalSampler(dataset, **kwargs), drop_last=False, seed=seed)
