"""Data: the built-in synthetic task, a data module's prepare_data/setup, and the samplers and loaders that give
every step its global batch."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, SequentialSampler
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
    settings = _settings(data, split)
    indices = list(range(min(FIRST_SAMPLES, settings["batch_size"], len(dataset))))
    custom = settings["collate_fn"] if settings["collate_fn"] is not collate else None
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


def _settings(data: Any, split: str) -> dict:
    """The loader settings of `split`: a LoaderData's, taken from that split's own DataLoader, or the data's."""
    given = data.split_settings.get(split) if isinstance(data, LoaderData) else None
    return given or {"batch_size": data.batch_size, "collate_fn": getattr(data, "collate_fn", collate),
                     "num_workers": int(getattr(data, "num_workers", 0)),
                     "pin_memory": bool(getattr(data, "pin_memory", False))}


def _loader(data: Any, split: str, sampler: Sampler, drop_last: bool, seed: int) -> DataLoader:
    settings = _settings(data, split)
    workers = settings["num_workers"]
    return DataLoader(
        getattr(data, f"{split}_dataset"),
        batch_size=settings["batch_size"],
        sampler=sampler,
        drop_last=drop_last,
        num_workers=workers,
        # Pinned memory only speeds up copies to a GPU; without one torch warns and ignores it.
        pin_memory=settings["pin_memory"] and torch.cuda.is_available(),
        persistent_workers=workers > 0,
        collate_fn=settings["collate_fn"],
        # The loader's own generator keeps the global RNG untouched, so resuming mid-epoch is exact.
        generator=torch.Generator().manual_seed(seed),
    )


def train_loader(data: Any, sampler_kwargs: Optional[dict], seed: int) -> DataLoader:
    kwargs = sampler_kwargs or {"num_replicas": 1, "rank": 0}
    sampler = TrainSampler(data.train_dataset, _settings(data, "train")["batch_size"], seed=seed, **kwargs)
    return _loader(data, "train", sampler, drop_last=True, seed=seed)


def val_loader(data: Any, sampler_kwargs: Optional[dict], seed: int, split: str = "val") -> Optional[DataLoader]:
    """The loader of `<split>_dataset` (val, test or predict): every sample once over the processes, in order."""
    dataset = getattr(data, f"{split}_dataset", None)
    if dataset is None or len(dataset) == 0:
        return None
    kwargs = sampler_kwargs or {"num_replicas": 1, "rank": 0}
    return _loader(data, split, EvalSampler(dataset, **kwargs), drop_last=False, seed=seed)


# -- data modules: prepare_data, setup, DataLoaders ---------------------------------------------------

# The splits each stage reads (fit tests afterwards, when the data has a test split: see `ready`).
STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


def is_data_module(data: Any) -> bool:
    """Whether the data makes its data sets in prepare_data()/setup(), as a LightningDataModule does: they exist
    only once the worker has called them."""
    return any(callable(getattr(data, name, None)) for name in ("prepare_data", "setup"))


def prepare(data: Any, strategy: Any, stage: str) -> Any:
    """A LightningDataModule's order: `prepare_data()` once per node (its local rank 0; the other processes wait),
    then `setup(stage)` in every process; the data the runner's loaders read comes back (see `ready`)."""
    if callable(getattr(data, "prepare_data", None)):
        _once_per_node(data.prepare_data, strategy, per_node=getattr(data, "prepare_data_per_node", True))
    return ready(data, stage)


def ready(data: Any, stage: str) -> Any:
    """`data` after `setup(stage)` (where it has one): itself, or, when it gives DataLoaders for the stage's splits
    (`train_dataloader()`, ...) instead of data sets, a LoaderData of them."""
    source = data.source if isinstance(data, LoaderData) else data
    if callable(getattr(source, "setup", None)):
        source.setup(stage)
    splits = STAGE_SPLITS[stage]
    gives_loaders = any(getattr(source, f"{split}_dataset", None) is None and _loader_method(source, split)
                        for split in splits)
    return LoaderData(source, splits) if gives_loaders else source


def _loader_method(source: Any, split: str) -> Optional[Callable[[], Any]]:
    """`source.<split>_dataloader`, unless it is Lightning's placeholder (its DataHooks' raise when not overridden)."""
    name = f"{split}_dataloader"
    owner = next((cls for cls in type(source).__mro__ if name in vars(cls)), None)
    method = getattr(source, name, None)
    return method if callable(method) and not (owner is not None and owner.__name__ == "DataHooks") else None


def _once_per_node(prepare_data: Callable[[], Any], strategy: Any, per_node: bool) -> None:
    """Call `prepare_data` in one process per node (or of the job, `per_node` False) while the others wait; a
    failure there ends every process (the others with a line that points to it)."""
    chosen = strategy is None or (strategy.local_rank if per_node else strategy.global_rank) == 0
    error: Optional[BaseException] = None
    if chosen:
        try:
            prepare_data()
        except Exception as raised:  # noqa: BLE001 - re-raised below, after the others know
            error = raised
    failed = strategy.reduce_boolean_decision(error is not None, all=False) if strategy is not None else False
    if error is not None:
        raise error
    if failed:  # a consequence, said without a traceback: the launcher reports the cause
        from runner.errors import WorkerFailed

        where = "local rank 0 of a node" if per_node else "global rank 0"
        raise WorkerFailed(strategy.global_rank, f"data.prepare_data() failed on {where}; that process's log has "
                                                 "the error")


_PLAIN_SAMPLERS = (RandomSampler, SequentialSampler)  # what DataLoader(shuffle=True/False) makes itself


class LoaderData:
    """The data sets of a data object's DataLoaders (`<split>_dataloader()`, as a LightningDataModule gives them),
    with each loader's batch_size, collate_fn, num_workers and pin_memory.

    The runner's own samplers take each process's share (the same global batches on any number of processes,
    every evaluation sample once, an exact resume), so a loader's shuffle, drop_last and other settings are not
    kept, and a loader with a sampler of its own is refused.
    """

    def __init__(self, source: Any, splits: tuple[str, ...]) -> None:
        from runner.config import ConfigError

        self.source = source
        self.split_settings: dict[str, dict] = {}
        for split in splits:
            dataset = getattr(source, f"{split}_dataset", None)
            make = _loader_method(source, split)
            loader = make() if dataset is None and make is not None else None
            if dataset is not None or loader is None:
                setattr(self, f"{split}_dataset", dataset)
                continue
            problem = _own_sampler(loader, f"data ({type(source).__name__}): {split}_dataloader()", split)
            if problem:
                raise ConfigError([problem])
            setattr(self, f"{split}_dataset", loader.dataset)
            # torch's default collate is the runner's, which also passes a batch fetched whole (__getitems__)
            own_collate = loader.collate_fn if loader.collate_fn is not default_collate else collate
            self.split_settings[split] = {"batch_size": loader.batch_size, "collate_fn": own_collate,
                                          "num_workers": loader.num_workers, "pin_memory": loader.pin_memory}
        first = next(iter(self.split_settings.values()), {})  # what a data set given as such is read with
        self.batch_size = first.get("batch_size", getattr(source, "batch_size", None))
        self.collate_fn = first.get("collate_fn", getattr(source, "collate_fn", collate))
        self.num_workers = first.get("num_workers", getattr(source, "num_workers", 0))
        self.pin_memory = first.get("pin_memory", getattr(source, "pin_memory", False))


def _own_sampler(loader: DataLoader, what: str, split: str) -> Optional[str]:
    """Why the runner cannot take `loader`'s data set as it is: not one DataLoader (several validation loaders), a
    sampler or batch sampler of its own, or none (batch_size=None: no batching)."""
    if not isinstance(loader, DataLoader):
        return (f"{what} gave {type(loader).__name__}, not one DataLoader: the runner reads one loader per stage "
                f"(for several data sets, concatenate them, or give the one to use as {split}_dataset)")
    if loader.batch_size is None and loader.batch_sampler is None:
        return f"{what} has batch_size=None (no batching): give it a batch size (per process)"
    plain = type(loader.sampler) in _PLAIN_SAMPLERS and not (
        isinstance(loader.sampler, RandomSampler) and (loader.sampler.replacement
                                                       or loader.sampler._num_samples is not None))
    # DataLoader's batch_size is None exactly when it was given a batch_sampler
    own = loader.sampler if not plain else loader.batch_sampler if loader.batch_size is None else None
    if own is None:
        return None
    return (f"{what} has a sampler of its own ({type(own).__name__}); the runner's samplers take each "
            "process's samples (exact metrics over processes, the same global batches on any number of them), so "
            f"give a DataLoader without sampler or batch_sampler, or the data set itself as {split}_dataset")
