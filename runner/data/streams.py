"""Streams: iterable data sets (torch's IterableDataset, HuggingFace's streaming datasets, anything with `__iter__`
and no indexing), read in one global order that does not depend on the number of processes or loader workers.

The stream's samples s0, s1, ... form global batches of B x W samples (B per process, W processes); rank r takes
samples r, r+W, ... of each, as it takes positions of a map-style set's order. Every process (and each of its loader
workers) reads the whole stream and keeps its share: worker w of K makes this process's batches w, w+K, ..., which
the DataLoader hands out in turn. A resume replays the stream to the global sample it stopped at, so it continues
exactly on any number of processes; a stream with a position of its own (`state_dict()`/`load_state_dict()`, as
HuggingFace's IterableDataset has) read in the training process itself continues from that position instead.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Iterator

from torch.utils.data import IterableDataset, get_worker_info

log = logging.getLogger("runner")


def is_stream(dataset: Any) -> bool:
    """Whether `dataset` is read by iterating it (no indexing): a stream, not a map-style set."""
    indexed = hasattr(dataset, "__getitem__")
    return isinstance(dataset, IterableDataset) or (hasattr(dataset, "__iter__") and not indexed)


def stream_length(dataset: Any) -> Any:
    """The stream's number of samples, or None where it does not say (or says it by raising)."""
    try:
        return len(dataset)
    except (TypeError, NotImplementedError):
        return None


class StreamShare(IterableDataset):
    """This process's batches of a stream, collated. `whole`: only global batches the stream fills (training: every
    process takes the same number of steps); else the last, partial one too (evaluation: every sample once)."""

    def __init__(self, stream: Any, batch_size: int, num_replicas: int, rank: int, collate_fn: Callable,
                 whole: bool) -> None:
        self.stream, self.batch_size, self.num_replicas, self.rank = stream, batch_size, num_replicas, rank
        self.collate_fn, self.whole = collate_fn, whole
        self.epoch, self.start_batch = 0, 0
        self.size = stream_length(stream)
        self.in_process = True  # read by the process itself: its loader has no workers, each with a copy
        self._restored = False  # the stream stands where the checkpoint stopped: no replay

    def state_dict(self) -> dict:
        """The stream's own position, where it has one and is read in this process (with loader workers each
        holds a copy of its own, and a resume replays)."""
        own = getattr(self.stream, "state_dict", None)
        return {"stream": own()} if callable(own) and self.in_process else {}

    def load_state_dict(self, state: dict) -> None:
        own = getattr(self.stream, "load_state_dict", None)
        if "stream" in state and callable(own) and self.in_process:
            own(state["stream"])
            self._restored = True

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        """This process's batches in an epoch, from where it starts; a TypeError when the stream does not say."""
        if self.size is None:
            raise TypeError(f"the stream {type(self.stream).__name__} has no length")
        per_batch = self.batch_size * self.num_replicas
        batches = self.size // per_batch if self.whole else -(-self.size // per_batch)
        return max(0, batches - self.start_batch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        restored, self._restored = self._restored, False
        if callable(getattr(self.stream, "set_epoch", None)) and not restored:
            self.stream.set_epoch(self.epoch)  # a stream's own shuffle (HF's buffer) follows the epoch
        samples = iter(self.stream)
        per_batch = self.batch_size * self.num_replicas
        if restored and self.rank == 0:
            log.info("resuming the stream %s from its own position (its state_dict), %d samples into epoch %d",
                     type(self.stream).__name__, self.start_batch * per_batch, self.epoch)
        elif self.start_batch:
            self._replay(samples, self.start_batch * per_batch, announce=worker == 0)
        for batch in itertools.count():
            chunk = list(itertools.islice(samples, per_batch))
            if not chunk or (self.whole and len(chunk) < per_batch):
                return
            mine = chunk[self.rank::self.num_replicas]
            if batch % workers == worker and mine:
                yield self.collate_fn(mine)

    def _replay(self, samples: Iterator[Any], count: int, announce: bool) -> None:
        start = time.perf_counter()
        read = sum(1 for _ in itertools.islice(samples, count))
        if announce and self.rank == 0:
            log.info("resuming the stream %s: read past its first %d samples (epoch %d) in %.1fs",
                     type(self.stream).__name__, read, self.epoch, time.perf_counter() - start)
