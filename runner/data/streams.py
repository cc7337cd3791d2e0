"""Streams: iterable data sets (torch's IterableDataset, HuggingFace's streaming datasets, anything with `__iter__`
and no indexing), read in one global order that does not depend on the number of processes or loader workers.

The stream's samples s0, s1, ... form global batches of B x W samples (B per process, W processes); rank r takes
samples r, r+W, ... of each, as it takes positions of a map-style set's order. Every process (and each of its loader
workers) reads the whole stream and keeps its share: worker w of K makes this process's batches w, w+K, ... from
where the pass starts, which the DataLoader hands out in turn, each numbered, so that the reading process sees at once
a stream that reads otherwise in a worker. A stream that splits itself over workers with torch's get_worker_info()
does not see it (each worker reads it whole); one that splits itself by its shards (HuggingFace's) is read in the
training process instead. A resume replays the stream to the global sample it stopped at, so it continues exactly on
any number of processes; a stream with a position of its own (`state_dict()`/`load_state_dict()`, as HuggingFace's
IterableDataset has) read in the training process itself continues from that position instead.

What the global order rests on is checked as the stream is read: a stream that says its length yields exactly that
many samples, and a replay finds the samples it replays.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import IterableDataset, get_worker_info

from runner.errors import DataError, call_hook

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


def shards_itself(stream: Any) -> Optional[str]:
    """How `stream` splits itself over loader workers, in words, or None. A HuggingFace IterableDataset gives each
    loader worker some of its shards (and stops the workers beyond its `n_shards`), so a worker never reads the
    whole stream."""
    shards = getattr(stream, "n_shards", None)
    if type(stream).__module__.startswith("datasets.") and isinstance(shards, int):
        return f"it gives each loader worker some of its {shards} shard(s)"
    return None


def _whole(stream: Any) -> Iterator[Any]:
    """The stream read in a loader worker as the training process reads it: torch's worker info is hidden from it
    while it runs, so that a stream that splits itself over workers (torch's get_worker_info() recipe) still gives
    every worker every sample, each worker keeping its own batches of them."""
    from torch.utils.data._utils import worker as state

    if not hasattr(state, "_worker_info"):  # a torch that keeps it elsewhere: the numbered batches still check
        yield from stream
        return
    info = state._worker_info
    state._worker_info = None
    try:
        samples = iter(stream)
    finally:
        state._worker_info = info
    while True:
        state._worker_info = None
        try:
            sample = next(samples)
        except StopIteration:
            return
        finally:
            state._worker_info = info
        yield sample


class StreamEnd:
    """What a loader worker sends after its last batch: the stream's samples it read in the epoch."""

    def __init__(self, worker: int, read: int) -> None:
        self.worker, self.read = worker, read


class StreamShare(IterableDataset):
    """This process's batches of a stream, collated. `whole`: only global batches the stream fills (training: every
    process takes the same number of steps); else the last, partial one too (evaluation: every sample once).
    `numbered`: each batch comes as (its number in the epoch, batch), and each worker's end as a StreamEnd (loader
    workers: the reading loader checks their order)."""

    def __init__(self, stream: Any, batch_size: int, num_replicas: int, rank: int, collate_fn: Callable,
                 whole: bool, split: str = "train") -> None:
        self.stream, self.batch_size, self.num_replicas, self.rank = stream, batch_size, num_replicas, rank
        self.collate_fn, self.whole = collate_fn, whole
        self.epoch, self.start_batch = 0, 0
        self.size = stream_length(stream)
        self.what = f"data.{split}_dataset ({type(stream).__name__})"
        self.in_process = True  # read by the process itself: its loader has no workers, each with a copy
        self.numbered = False
        self.read = 0  # the stream's samples read in this epoch so far (in this process)
        self._restored = False  # the stream stands where the checkpoint stopped: no replay

    def state_dict(self) -> dict:
        """The stream's own position, where it has one and is read in this process (with loader workers each
        holds a copy of its own, and a resume replays)."""
        own = getattr(self.stream, "state_dict", None)
        if not (callable(own) and self.in_process):
            return {}
        return {"stream": call_hook(f"{self.what}.state_dict()", own)}

    def load_state_dict(self, state: dict) -> None:
        own = getattr(self.stream, "load_state_dict", None)
        if "stream" in state and callable(own) and self.in_process:
            call_hook(f"{self.what}.load_state_dict()", lambda: own(state["stream"]))
            self._restored = True

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def epoch_batches(self) -> Optional[int]:
        """This process's batches in a whole epoch (None: the stream does not say its length)."""
        if self.size is None:
            return None
        per_batch = self.batch_size * self.num_replicas
        if self.whole:
            return self.size // per_batch
        # The last, partial global batch gives a batch to the ranks its samples reach.
        return self.size // per_batch + int(self.rank < self.size % per_batch)

    def __len__(self) -> int:
        """This process's batches in an epoch, from where it starts; a TypeError when the stream does not say."""
        if self.size is None:
            raise TypeError(f"the stream {type(self.stream).__name__} has no length")
        return max(0, self.epoch_batches - self.start_batch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        restored, self._restored = self._restored, False
        if callable(getattr(self.stream, "set_epoch", None)) and not restored:
            self.stream.set_epoch(self.epoch)  # a stream's own shuffle (HF's buffer) follows the epoch
        samples = _whole(self.stream) if info is not None else iter(self.stream)
        per_batch = self.batch_size * self.num_replicas
        self.read = self.start_batch * per_batch
        if restored:
            if self.rank == 0 and worker == 0:
                log.info("resuming the stream %s from its own position (its state_dict), %d samples into epoch %d",
                         type(self.stream).__name__, self.read, self.epoch)
        elif self.start_batch:
            self._replay(samples, self.read, announce=worker == 0)
        last = self._last_global_batch()
        for batch in itertools.count(self.start_batch):
            chunk = list(itertools.islice(samples, per_batch))
            self.read += len(chunk)
            if not chunk or (self.whole and len(chunk) < per_batch):
                self._check_length(self.read)
                break
            if batch == last:  # the last global batch its length promises: nothing may follow it
                self._check_length(self.read + sum(1 for _ in itertools.islice(samples, self.size - self.read + 1)))
            mine = chunk[self.rank::self.num_replicas]
            if (batch - self.start_batch) % workers == worker and mine:  # the DataLoader asks worker 0 first
                yield (batch, self.collate_fn(mine)) if self.numbered else self.collate_fn(mine)
            if batch == last:
                break
        if self.numbered:
            yield StreamEnd(worker, self.read)

    def _last_global_batch(self) -> Optional[int]:
        """The number of the epoch's last global batch its length promises (the partial one for evaluation)."""
        if self.size is None:
            return None
        per_batch = self.batch_size * self.num_replicas
        batches = self.size // per_batch if self.whole else -(-self.size // per_batch)
        return batches - 1

    def _check_length(self, read: int) -> None:
        """A stream that says its length must yield that many samples (the plan of steps and each process's
        share rest on it)."""
        if self.size is not None and read != self.size:
            more = "more" if read > self.size else f"{read}"
            raise DataError(f"{self.what} says len() = {self.size} samples but yielded {more} in epoch "
                            f"{self.epoch} (rank {self.rank}): a stream's __len__ must count what its __iter__ "
                            "yields (or leave __len__ out and set trainer.max_steps)")

    def _replay(self, samples: Iterator[Any], count: int, announce: bool) -> None:
        start = time.perf_counter()
        read = sum(1 for _ in itertools.islice(samples, count))
        if read < count:
            raise DataError(f"{self.what}: resuming {count} samples into epoch {self.epoch}, but the stream ended "
                            f"after {read} (rank {self.rank}): it is not the stream the checkpoint was trained on; "
                            "resume on that data, or set trainer.data_resume=restart to start the epoch afresh")
        if announce and self.rank == 0:
            log.info("resuming the stream %s: read past its first %d samples (epoch %d) in %.1fs",
                     type(self.stream).__name__, read, self.epoch, time.perf_counter() - start)
