"""The order of samples: one global order per epoch, of which each process takes its share of every global batch.

Global batch k (B samples per process, W processes) is positions [kBW, (k+1)BW) of the epoch's order, and rank r
takes positions kBW + r, kBW + r + W, ...: step t trains on the same samples for any W at one global batch size.
The order is a map-style set's shuffle or a user's sampler drawn from (seed, epoch), the same on every process.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import sys
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset, Sampler

# Indices turned into Python ints at a time: the epoch's order itself stays a tensor (4 bytes a sample below 2^31).
CHUNK = 1 << 16


class Shuffled:
    """A map-style set's order: a permutation of its samples drawn from seed + epoch (DistributedSampler's order)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.name = "shuffled"

    def __len__(self) -> int:
        return self.size

    def draw(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        dtype = torch.int32 if self.size < 2**31 else torch.int64  # the same permutation either way
        return torch.randperm(self.size, generator=generator, dtype=dtype)


class Drawn:
    """A user's sampler (weighted, class-balanced, curriculum) as the global order: drawn with every random source
    it may read (its `generator`, torch's, Python's and NumPy's global ones) seeded from seed + epoch, so every
    process draws the same list, and a resume draws the epoch it stopped in again."""

    def __init__(self, sampler: Sampler, seed: int, what: str) -> None:
        self.sampler, self.seed, self.what = sampler, seed, what
        self.name = f"sampler {type(sampler).__name__}"
        self._checked = False

    def __len__(self) -> int:
        return len(self.sampler)

    def draw(self, epoch: int) -> torch.Tensor:
        order = self._draw(epoch)
        if not self._checked:  # once: a sampler with a random state of its own cannot be replayed or shared
            self._checked = True
            if not torch.equal(order, self._draw(epoch)):
                from runner.config import ConfigError

                raise ConfigError([
                    f"{self.what}: its sampler {type(self.sampler).__name__} gives another order each time it is "
                    "drawn with the same seeds, so the processes would draw different samples and a resume could "
                    "not replay its epoch; give it a `generator` attribute (torch.Generator) or let it draw from "
                    "torch's random numbers"])
        return order

    def _draw(self, epoch: int) -> torch.Tensor:
        seed = self.seed + epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)
        size = len(self.sampler)
        with _seeded(seed), _own_generator(self.sampler, seed):
            # At most one index beyond its length: a sampler that never ends is found, not drawn forever.
            order = list(itertools.islice(self.sampler, size + 1))
        if len(order) != size:
            from runner.errors import DataError

            raise DataError(f"{self.what}: its sampler {type(self.sampler).__name__} says len() = {size} but yielded "
                            f"{'more' if len(order) > size else len(order)} indices in epoch {epoch}: a sampler's "
                            "__len__ must count what its __iter__ yields (the steps of an epoch are planned from it)")
        return torch.as_tensor(order, dtype=torch.int64)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """torch's, Python's and (where imported) NumPy's global random numbers seeded for the block, then put back."""
    numpy = sys.modules.get("numpy")
    python, saved_numpy = random.getstate(), numpy.random.get_state() if numpy else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        if numpy:
            numpy.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python)
            if numpy:
                numpy.random.set_state(saved_numpy)


@contextlib.contextmanager
def _own_generator(sampler: Any, seed: int) -> Iterator[None]:
    """A sampler's own `generator` (RandomSampler's, WeightedRandomSampler's) seeded for the block, then put back."""
    if not hasattr(sampler, "generator"):
        yield
        return
    saved = sampler.generator
    sampler.generator = torch.Generator().manual_seed(seed)
    try:
        yield
    finally:
        sampler.generator = saved


class TrainSampler(Sampler[int]):
    """Rank r of W takes positions r, r+W, ... of each epoch's global order (the tail that does not fill a position
    on every process is dropped); `start_batch` skips the batches a resumed run already trained on this epoch."""

    def __init__(self, order: Any, batch_size: int, num_replicas: int, rank: int) -> None:
        self.order, self.batch_size, self.num_replicas, self.rank = order, batch_size, num_replicas, rank
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_samples(self) -> int:
        """This process's samples per epoch."""
        return len(self.order) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        order = self.order.draw(self.epoch)
        mine = order[self.rank: len(order) // self.num_replicas * self.num_replicas: self.num_replicas]
        for chunk in mine[self.start_batch * self.batch_size:].split(CHUNK):
            yield from chunk.tolist()

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
