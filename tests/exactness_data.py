"""Data and a model for the exactness oracle (tests/test_exactness.py), importable by launched workers: one small
float64 classification task read as each kind of data a user brings, and the faulty kinds the runner must refuse.

Every kind yields the same samples; what differs is how: a map-style set (tuples or dicts), a user's sampler, a
torch stream with or without len() or a position of its own, a DataLoader over a stream, a HuggingFace streaming
dataset with a batched map. The global order of each kind is fixed by its own rules (a shuffle, a weighted draw,
the stream's order), the same on any number of processes: that is what the oracle checks.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, WeightedRandomSampler, get_worker_info

FEATURES, CLASSES = 6, 3


def samples(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` float64 inputs labelled by a fixed random teacher."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    inputs = torch.randn(count, FEATURES, generator=generator, dtype=torch.float64)
    return inputs, (inputs @ teacher).argmax(dim=1)


class Pairs(Dataset):
    """Map-style: (inputs, label) or {"x": inputs, "labels": label}."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, as_dict: bool = False) -> None:
        self.inputs, self.targets, self.as_dict = inputs, targets, as_dict

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> Any:
        if self.as_dict:
            return {"x": self.inputs[index], "labels": self.targets[index]}
        return self.inputs[index], self.targets[index]


class Stream(IterableDataset):
    """The pairs in order, as a stream. `sized`: it says its length (`claimed`, when it lies). `fault`:
    one_pass (its __iter__ hands back one generator), rank_short (rank 1's ends 24 samples early), worker_split
    (each loader worker reads its share only), blocks (after 40 samples it sends its process SIGTERM and waits)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, sized: bool, claimed: Optional[int] = None,
                 fault: str = "") -> None:
        self.inputs, self.targets, self.sized, self.claimed, self.fault = inputs, targets, sized, claimed, fault
        self._once: Optional[Iterator] = None

    def _pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        count, step = len(self.targets), 1
        if self.fault == "rank_short" and os.environ.get("RANK") == "1":
            count -= 24
        info = get_worker_info()
        first = info.id if self.fault == "worker_split" and info is not None else 0
        step = info.num_workers if self.fault == "worker_split" and info is not None else 1
        for index in range(first, count, step):  # worker_split: torch's recipe for splitting over workers
            if self.fault == "blocks" and index == 40:  # then it waits for data that never comes
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(300)
            yield self.inputs[index], self.targets[index]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.fault == "one_pass":
            self._once = self._once or self._pairs()
            return self._once
        return self._pairs()

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("a stream of unknown length")
        return self.claimed if self.claimed is not None else len(self.targets)



class ObjectStateStream(Stream):
    """A stream whose state_dict() returns something no checkpoint can hold (or, `fault` raising_state, raises)."""

    def state_dict(self) -> dict:
        if self.fault == "raising_state":
            raise ValueError("no position yet")
        return {"pos": object()}

    def load_state_dict(self, state: dict) -> None:
        pass


class PositionedStream(IterableDataset):
    """A stream with a position of its own (state_dict/load_state_dict, as HuggingFace's has), per epoch."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets
        self.position, self.epoch, self._start = 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._start = epoch, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self._start = self._start, 0
        for index in range(start, len(self.targets)):
            self.position = index + 1
            yield self.inputs[index], self.targets[index]

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._start = state["epoch"], state["position"]


class CountedSampler(Sampler[int]):
    """A sampler whose len() lies: it says `claimed` indices and yields `count` (index 0 forever: count=None)."""

    def __init__(self, claimed: int, count: Optional[int]) -> None:
        self.claimed, self.count = claimed, count

    def __iter__(self) -> Iterator[int]:
        index = 0
        while self.count is None or index < self.count:
            yield 0 if self.count is None else index
            index += 1

    def __len__(self) -> int:
        return self.claimed


def _drop_tenth(batch: dict) -> dict:
    """A batched map that changes the number of samples (as run_clm's grouping does): every tenth is dropped."""
    keep = [i for i, index in enumerate(batch["index"]) if index % 10 != 9]
    return {key: [values[i] for i in keep] for key, values in batch.items()}


def hf_stream(inputs: torch.Tensor, targets: torch.Tensor) -> Any:
    from datasets import Dataset as HFDataset

    table = {"x": inputs.tolist(), "labels": targets.tolist(), "index": list(range(len(targets)))}
    stream = HFDataset.from_dict(table).to_iterable_dataset(num_shards=1)
    return stream.map(_drop_tenth, batched=True, batch_size=10).remove_columns("index").with_format("torch")


KINDS = ("map", "dict", "sampler", "stream", "stream_len", "stream_state", "stream_loader", "hf")


LOADER_KINDS = ("sampler", "stream_loader", "short_sampler", "endless_sampler")


class OracleData:
    """The oracle's data as `kind` reads it (see KINDS; the kinds given as loaders are OracleLoaders'), and the
    faulty kinds: one_pass, lying_len, long_stream, rank_short, worker_split, blocks, object_state, raising_state,
    endless_val."""

    def __init__(self, kind: str = "map", batch_size: int = 12, num_workers: int = 0, num_samples: int = 96,
                 val_samples: int = 13, seed: int = 0) -> None:
        self.kind, self.batch_size, self.num_workers = kind, batch_size, num_workers
        train, val = samples(num_samples, seed), samples(val_samples, seed + 1)
        self._train, self._val = train, val
        self.train_dataset: Any = Pairs(*train, as_dict=kind == "dict")
        self.val_dataset: Any = Pairs(*val, as_dict=kind == "dict")
        if kind in ("stream", "stream_len", "one_pass", "rank_short", "worker_split", "blocks"):
            sized = kind == "stream_len"
            self.train_dataset = Stream(*train, sized=sized, fault="" if kind in ("stream", "stream_len") else kind)
            self.val_dataset = Stream(*val, sized=sized)
        elif kind in ("object_state", "raising_state"):
            self.train_dataset = ObjectStateStream(*train, sized=False, fault=kind)
        elif kind in ("lying_len", "long_stream"):  # says 1000 and yields 96; says 50 and yields 96
            self.train_dataset = Stream(*train, sized=True, claimed=1000 if kind == "lying_len" else 50)
        elif kind == "stream_state":
            self.train_dataset = PositionedStream(*train)
        elif kind == "hf":
            self.train_dataset, self.val_dataset = hf_stream(*train), hf_stream(*val)
        elif kind == "endless_val":
            self.val_dataset = _Endless(*val)



class OracleLoaders(OracleData):
    """The kinds whose training data comes as a data module's DataLoader: a user's sampler (sampler; short_sampler
    and endless_sampler, whose len() lies) or a stream (stream_loader)."""

    def __init__(self, kind: str = "sampler", **settings: Any) -> None:
        super().__init__(kind, **settings)

    def setup(self, stage: str) -> None:
        self.train_dataset = None

    def train_dataloader(self) -> DataLoader:
        inputs, targets = self._train
        if self.kind == "stream_loader":
            return DataLoader(Stream(inputs, targets, sized=False), batch_size=self.batch_size,
                              num_workers=self.num_workers)
        if self.kind == "sampler":
            weights = 1.0 / torch.bincount(targets).double()[targets]
            sampler: Sampler = WeightedRandomSampler(weights, num_samples=len(targets), replacement=True)
        else:
            sampler = CountedSampler(len(targets) if self.kind == "endless_sampler" else 512,
                                     None if self.kind == "endless_sampler" else 10)
        return DataLoader(Pairs(inputs, targets), batch_size=self.batch_size, sampler=sampler,
                          num_workers=self.num_workers)


class _Endless(IterableDataset):
    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        index = 0
        while True:
            yield self.inputs[index % len(self.targets)], self.targets[index % len(self.targets)]
            index += 1


class OracleNet(nn.Module):
    """Linear → (BatchNorm) → tanh → linear, in float64 under precision=64-true. `signal_at`: the training forward
    (micro-batch) after which rank `signal_rank` sends itself SIGTERM (0: never); `val_signal_at`: the validation
    forward after which it does."""

    def __init__(self, hidden: int = 8, batchnorm: bool = False, signal_at: int = 0, signal_rank: int = 0,
                 val_signal_at: int = 0) -> None:
        super().__init__()
        layers = [nn.Linear(FEATURES, hidden), *([nn.BatchNorm1d(hidden)] if batchnorm else []), nn.Tanh(),
                  nn.Linear(hidden, CLASSES)]
        self.net = nn.Sequential(*layers)
        self.signal_at, self.signal_rank, self.calls = signal_at, signal_rank, 0
        self.val_signal_at, self.val_calls = val_signal_at, 0  # the same, counting validation forward passes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta" and self.training and self.signal_at:
            self.calls += 1
            self._signal_if(self.calls == self.signal_at)
        elif x.device.type != "meta" and not self.training and self.val_signal_at:
            self.val_calls += 1
            self._signal_if(self.val_calls == self.val_signal_at)
        return self.net(x)

    def _signal_if(self, due: bool) -> None:
        if due and int(os.environ.get("RANK", "0")) == self.signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)
