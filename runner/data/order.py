"""The order of samples: one global order per epoch, of which each process takes its share of every global batch."""

from __future__ import annotations

from typing import Iterator

from torch.utils.data import Dataset, DistributedSampler, Sampler


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


