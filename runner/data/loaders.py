"""The loaders the loop reads: each process's share of the global order, with the data's loader settings."""

from __future__ import annotations

import logging
import math
import re
import signal
import threading
import time
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Sampler

from runner.data.batches import collate
from runner.data.modules import LoaderData
from runner.data.order import Drawn, EvalSampler, Shuffled, TrainSampler
from runner.data.streams import StreamEnd, StreamShare, is_stream, shards_itself
from runner.errors import DataError

log = logging.getLogger("runner")

# Samples a check collates, at most: enough to meet differing shapes, few enough to read in microseconds.
FIRST_SAMPLES = 4


def first_batch_problem(data: Any, split: str) -> Optional[str]:
    """Why the first samples of `data.<split>_dataset` do not form a batch as the loader forms it, or None."""
    dataset = getattr(data, f"{split}_dataset", None)
    if dataset is None or is_stream(dataset) or len(dataset) == 0:
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


def _settings(data: Any, split: str) -> dict:
    """The loader settings of `split`: a LoaderData's, taken from that split's own DataLoader, or the data's."""
    given = data.split_settings.get(split) if isinstance(data, LoaderData) else None
    return given or {"batch_size": data.batch_size, "collate_fn": getattr(data, "collate_fn", collate),
                     "num_workers": int(getattr(data, "num_workers", 0)),
                     "pin_memory": bool(getattr(data, "pin_memory", False))}


class Loader(DataLoader):
    """A DataLoader whose failures name what failed: a sample, a collate or a stream that raises is one line naming
    the split and the error (torch's worker wrapper taken off), a loader worker that died says so; the traceback
    goes to the run's log files. `share`: the stream this loader reads, if it is one."""

    def __init__(self, *args: Any, split: str, share: Optional[StreamShare] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.split, self.share = split, share

    def __iter__(self) -> Iterator[Any]:
        reading = _Reading(super().__iter__(), self.split, self.num_workers)
        if self.num_workers:
            _deaths_found_when_read()
        return _Numbered(reading, self.share) if self.share is not None and self.share.numbered else reading


class _Reading:
    """A loader's iterator, its errors turned into `read_failed`'s."""

    def __init__(self, iterator: Any, split: str, workers: int) -> None:
        self._iterator, self._split, self._workers = iterator, split, workers

    def __iter__(self) -> "_Reading":
        return self

    def __len__(self) -> int:
        return len(self._iterator)

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            raise
        except Exception as error:  # noqa: BLE001 - whatever a batch's reading raises is the data's code's
            died = _dead_worker(self._iterator, error)  # a worker's death may first show as its broken pipe
            _stop_workers(self._iterator)
            cause = died.with_traceback(error.__traceback__) if died is not None else error  # the log's traceback
            raise read_failed(self._split, self._workers, cause) from error


def _dead_worker(iterator: Any, error: Exception) -> Optional[Exception]:
    """A loader worker of `iterator` that died, in torch's words, or None. A broken connection to a worker (the
    batch it was handing over) waits a moment for the worker's end to show."""
    workers = list(getattr(iterator, "_workers", ()))
    deadline = time.monotonic() + (1.0 if isinstance(error, (ConnectionError, EOFError)) and workers else 0.0)
    while True:
        for worker in workers:
            code = worker.exitcode
            if code:
                how = f"is killed by signal: {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                return RuntimeError(f"DataLoader worker (pid {worker.pid}) {how}")
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def _deaths_found_when_read() -> None:
    """torch's SIGCHLD handler, set with a loader's first workers, raises a dead worker's error wherever the main
    thread is: in a backward pass, or inside code that catches what it raises (a FLOP count, a log record). Without
    it a dead worker is found where the batches are read (the loader checks its workers while it waits), and said in
    one line there."""
    handler = signal.getsignal(signal.SIGCHLD)
    if (getattr(handler, "__module__", "") == "torch.utils.data._utils.signal_handling"
            and threading.current_thread() is threading.main_thread()):
        # The handler it replaced (a program's own), which it called after its check, is put back.
        cells = dict(zip(handler.__code__.co_freevars, (c.cell_contents for c in handler.__closure__ or ())))
        previous = cells.get("previous_handler")
        signal.signal(signal.SIGCHLD, previous if callable(previous) else signal.SIG_DFL)


def _stop_workers(iterator: Any) -> None:
    """End the loader's workers now, SIGCHLD held meanwhile: torch's handler for it raises a dead worker's error
    wherever the process is (in the middle of saying what failed), until the workers are shut down."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if not callable(shutdown):
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        shutdown()
    except Exception:  # noqa: BLE001 - already failing: the first error is the one to say
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class _Numbered:
    """A stream's batches from loader workers, each checked to come in its place of the global order: a stream
    that reads otherwise in a worker (one that splits itself over workers, or depends on the worker) is stopped at
    the first batch out of its place. The workers' ends (StreamEnd) say how much of the stream each read."""

    def __init__(self, reading: _Reading, share: StreamShare) -> None:
        self._reading, self._share = reading, share
        self._next, self._ends = share.start_batch, []

    def __iter__(self) -> "_Numbered":
        return self

    def __len__(self) -> int:
        return len(self._reading)

    def __next__(self) -> Any:
        while True:
            item = next(self._reading)
            if isinstance(item, StreamEnd):
                self._ended(item)
                continue
            number, batch = item
            if number != self._next:
                raise DataError(f"{self._share.what} reads otherwise in its loader workers: batch {number} of epoch "
                                f"{self._share.epoch} came where batch {self._next} belongs (rank "
                                f"{self._share.rank}); each loader worker must read the whole stream (a stream that "
                                "splits itself over workers with torch's get_worker_info() does not): set "
                                "data.num_workers=0")
            self._next += 1
            return batch

    def _ended(self, end: StreamEnd) -> None:
        self._ends.append(end)
        self._share.read = max(e.read for e in self._ends)
        if len({e.read for e in self._ends}) > 1:
            counts = ", ".join(f"worker {e.worker}: {e.read}" for e in sorted(self._ends, key=lambda e: e.worker))
            raise DataError(f"{self._share.what} gave its loader workers different samples in epoch "
                            f"{self._share.epoch} (rank {self._share.rank}; samples read by {counts}); each loader "
                            "worker must read the whole stream: set data.num_workers=0")


_WORKER_DIED = re.compile(r"DataLoader worker \(pid.*(exited unexpectedly|is killed by signal|exited with code)")


def read_failed(split: str, workers: int, error: Exception) -> Exception:
    """What the reading of `split`'s batches raised, as the one line a user reads; a runner error stays as it is
    (one a loader worker raised, without torch's wrapping)."""
    from runner.errors import HookFailed, error_line, is_user_error

    if isinstance(error, DataError) and str(error).startswith("Caught "):  # torch's copy of a worker's own
        return DataError(error_line(error).split(": ", 1)[-1])
    if is_user_error(error):
        return error
    source = f"data.{split}_dataset"
    return worker_died(f"a loader worker of {source}", workers, error) or HookFailed(f"reading a batch of {source}",
                                                                                     error)


def worker_died(what: str, workers: Any, error: BaseException) -> Optional[Exception]:
    """A loader worker's death in one line (torch's "exited unexpectedly" carries the signal in its cause), or None
    when `error` is not that. torch may raise it from its SIGCHLD handler wherever the process is (a backward
    pass): the worker catches it there too (runner.worker)."""
    from runner.errors import HookFailed

    died = [e for e in (error.__cause__, error) if e is not None and _WORKER_DIED.search(str(e))]
    if not died:
        return None
    said = str(died[0]).strip().rstrip(".")
    return HookFailed(what, error, what=(
        f"died: {said} (data.num_workers={workers}; a worker killed by SIGKILL is most often the out-of-memory "
        "killer: fewer workers or smaller samples)"))


def _loader(data: Any, split: str, sampler: Sampler, drop_last: bool, seed: int) -> DataLoader:
    settings = _settings(data, split)
    workers = settings["num_workers"]
    return Loader(
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
        split=split,
    )


def _as_is(batch: Any) -> Any:
    return batch  # a stream's share comes collated


def _stream_loader(share: StreamShare, settings: dict, seed: int, split: str) -> DataLoader:
    """A share's batches, made in its loader workers (numbered: the loader checks their order), or in this process
    where the stream splits itself over workers. Not persistent workers, which would keep the epoch and the start
    they were made with."""
    workers = settings["num_workers"]
    how = shards_itself(share.stream) if workers else None
    if how:
        log.info("%s is read in the training process, not in its data.num_workers=%d loader workers: %s, so no "
                 "worker would read the whole stream (the global order needs every sample in its place)",
                 share.what, workers, how)
        workers = 0
    share.in_process, share.numbered = workers == 0, workers > 0
    return Loader(share, batch_size=None, num_workers=workers,
                  pin_memory=settings["pin_memory"] and torch.cuda.is_available(), collate_fn=_as_is,
                  generator=torch.Generator().manual_seed(seed), split=split, share=share)


class TrainBatches:
    """What the loop reads of its training data: this process's batches (a DataLoader), their size, how many an
    epoch has (`batches`, math.inf for a stream of unknown length), and `identity`, what a checkpoint's position
    in them means (the order's kind and its samples per epoch)."""

    def __init__(self, loader: DataLoader, batch_size: int, position: Any, identity: dict, what: str) -> None:
        self.loader, self.batch_size, self._position, self.identity = loader, batch_size, position, identity
        self.what = what  # the data in a message: data.train_dataset (its class)
        self._forgotten = False

    @property
    def batches(self) -> float:
        try:
            return len(self.loader)
        except TypeError:  # a stream that does not say its length
            return math.inf

    def state_dict(self) -> dict:
        """Where the data stands beyond its position (a stream's own state), for the checkpoint; none once
        `forget_state` was called (a resume then replays the data to its position)."""
        if self._position is None or self._forgotten:
            return {}
        return getattr(self._position, "state_dict", dict)()

    def forget_state(self) -> None:
        """A read was cut short partway (a stop signal while waiting for data): the stream's own state is past the
        position the run stopped at, so the checkpoints keep the position alone."""
        self._forgotten = True

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self._position, "load_state_dict"):
            self._position.load_state_dict(state)

    def epoch(self, epoch: int, start_batch: int) -> Iterator[Any]:
        """The batches of `epoch` from its `start_batch`-th on."""
        self._position.set_epoch(epoch)
        self._position.start_batch = start_batch
        return iter(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)


def train_loader(data: Any, sampler_kwargs: Optional[dict], seed: int) -> TrainBatches:
    """This process's share of each global batch: of a stream, a user's sampler's order, or a shuffle of the set."""
    kwargs = sampler_kwargs or {"num_replicas": 1, "rank": 0}
    settings, dataset = _settings(data, "train"), data.train_dataset
    batch_size = settings["batch_size"]
    if is_stream(dataset):
        share = StreamShare(dataset, batch_size, collate_fn=settings["collate_fn"], whole=True, **kwargs)
        return TrainBatches(_stream_loader(share, settings, seed, "train"), batch_size, share,
                            {"order": f"stream {type(dataset).__name__}", "samples": share.size}, share.what)
    own = settings.get("sampler")
    order = (Drawn(own, seed, f"data ({type(getattr(data, 'source', data)).__name__}): train_dataloader()")
             if own is not None else Shuffled(len(dataset), seed))
    sampler = TrainSampler(order, batch_size, **kwargs)
    return TrainBatches(_loader(data, "train", sampler, drop_last=True, seed=seed), batch_size, sampler,
                        {"order": order.name, "samples": len(order)}, f"data.train_dataset ({type(dataset).__name__})")


def val_loader(data: Any, sampler_kwargs: Optional[dict], seed: int, split: str = "val") -> Optional[DataLoader]:
    """The loader of `<split>_dataset` (val, test or predict): every sample once over the processes, in order."""
    dataset = getattr(data, f"{split}_dataset", None)
    if dataset is None or (not is_stream(dataset) and len(dataset) == 0):
        return None
    kwargs = sampler_kwargs or {"num_replicas": 1, "rank": 0}
    if is_stream(dataset):
        settings = _settings(data, split)
        share = StreamShare(dataset, settings["batch_size"], collate_fn=settings["collate_fn"], whole=False,
                            split=split, **kwargs)
        return _stream_loader(share, settings, seed, split)
    return _loader(data, split, EvalSampler(dataset, **kwargs), drop_last=False, seed=seed)


def close(*loaders: Optional[DataLoader]) -> None:
    """End the loader worker processes of `loaders` now. torch ends a persistent loader's workers when its iterator
    is freed; freed by the cycle collector (the loop's objects refer to each other), the iterator's queues are
    closed before it asks its workers to stop, and each worker then waits out a 5 s join: 20 s at the end of a run
    with two loaders of two workers. Freed here, while whole, they stop at once."""
    for loader in loaders:
        loader = getattr(loader, "loader", loader)  # a TrainBatches' DataLoader
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            loader._iterator = None  # the last reference: torch's own __del__ shuts the workers down
            del iterator
