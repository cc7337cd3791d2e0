"""`logger=tensorboard`: TensorBoard event files written by the runner itself (no SummaryWriter on the step path)."""

from __future__ import annotations

import functools
import itertools
import os
import socket
import struct
import threading
import time
from typing import Any, Mapping, Optional

import google_crc32c

from runner.loggers.base import flat_params

_file_numbers = itertools.count()


def _masked_crc(data: bytes) -> bytes:
    """The record checksum of TensorBoard's event files: CRC-32C, rotated and offset (the TFRecord format)."""
    crc = google_crc32c.value(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


class EventFile:
    """One TensorBoard event file, written on the calling thread and flushed every `flush_secs` by another.

    An event is ~100 bytes: serialising it, its checksum (C code) and a buffered write take a few
    microseconds. SummaryWriter hands each event to a thread that computes the checksum in pure Python
    (~75 us an event), competing with the training thread for the interpreter; the flushing thread here
    wakes every `flush_secs` to make one write call, so a slow run's last events reach the disk as soon.
    """

    def __init__(self, log_dir: str, flush_secs: float, purge_step: Optional[int] = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self._event = Event
        os.makedirs(log_dir, exist_ok=True)
        # TensorBoard reads a folder's files in name order: this one must come after any earlier run's, even one
        # started in the same second by a process with a larger pid (its purge applies to what it reads before).
        stamp = max([int(time.time()), *(_stamp(name) + 1 for name in os.listdir(log_dir))])
        name = f"events.out.tfevents.{stamp:010d}.{socket.gethostname()}.{os.getpid()}.{next(_file_numbers)}"
        self.path = os.path.join(log_dir, name)
        self._file = open(self.path, "wb")  # noqa: SIM115 - open for the life of the run, closed by close()
        self.write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # TensorBoard drops what earlier files logged at or after this step
            self.write(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._file.flush()
        self._closing = threading.Event()
        self._flusher = threading.Thread(target=self._flush_every, args=(flush_secs,), daemon=True,
                                         name="runner-tensorboard-flush")
        self._flusher.start()

    def add_summary(self, summary: Any, step: int = 0) -> None:
        self.write(self._event(wall_time=time.time(), step=step, summary=summary))

    def write(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + _masked_crc(header) + data + _masked_crc(data))

    def flush(self) -> None:
        self._file.flush()

    def _flush_every(self, seconds: float) -> None:
        while not self._closing.wait(seconds):
            self._file.flush()  # the buffered file's own lock orders this against write()

    def close(self) -> None:
        self._closing.set()
        self._flusher.join()
        self._file.close()


def _stamp(name: str) -> int:
    """The seconds in an event file's name (-1 for other files)."""
    parts = name.split(".")
    return int(parts[3]) if name.startswith("events.out.tfevents.") and len(parts) > 3 and parts[3].isdigit() else -1


def _has_events(log_dir: str) -> bool:
    return os.path.isdir(log_dir) and any(name.startswith("events.out.tfevents.") for name in os.listdir(log_dir))


def _hparam_value(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) else str(value)


class TensorBoardLogger:
    """One event stream in `<root_dir>/<subdir>`, with the hyperparameters and final metrics for HParams.

    `experiment` is TensorBoard's SummaryWriter writing into that same stream (add_image, add_histogram,
    add_figure, add_text, add_scalar, ...), as Lightning's TensorBoardLogger has it.
    """

    def __init__(self, root_dir: str, subdir: str = "tensorboard", flush_secs: float = 30) -> None:
        if not (isinstance(flush_secs, (int, float)) and flush_secs > 0):
            raise ValueError(f"flush_secs={flush_secs} must be a positive number of seconds")
        self.save_dir, self.name, self.version = root_dir, subdir, None  # Lightning's names for the folders
        self.log_dir = os.path.join(root_dir, subdir)
        self.flush_secs = flush_secs
        self._events: Optional[EventFile] = None
        self._summary: Any = None  # tensorboard's Summary message, imported with the first write
        self._writer: Any = None  # the SummaryWriter `experiment` gives, made at its first use
        self._purge_step: Optional[int] = None
        self._last_step = 0
        self._logged: set[str] = set()
        self._params: dict[str, Any] = {}  # what the user's code gave log_hyperparams, for the run's HParams

    @property
    def root_dir(self) -> str:
        return self.log_dir

    @property
    def events(self) -> EventFile:
        if self._events is None:  # tensorboard is imported by the first write, not at start-up
            from tensorboard.compat.proto.summary_pb2 import Summary

            self._summary = Summary
            if self._purge_step is None and _has_events(self.log_dir):
                # A fresh start in a folder an earlier attempt wrote (a restart before its first checkpoint, a
                # re-run): TensorBoard drops the old events, or each step would appear twice.
                self._purge_step = 0
            self._events = EventFile(self.log_dir, self.flush_secs, self._purge_step)
        return self._events

    @property
    def experiment(self) -> Any:
        """TensorBoard's SummaryWriter, its events in this run's event file (no second file, no second thread)."""
        if self._writer is None:
            self._writer = _writer_class()(self)
        return self._writer

    def resume_at(self, step: int) -> None:
        """A resumed run: TensorBoard drops events at or after `step` that an earlier attempt wrote."""
        self._purge_step = step

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        """All of a step's scalars as one event: one write, not one per metric (`step` None: the last one logged)."""
        step = self._last_step if step is None else int(step)
        events = self.events
        summary = self._summary
        values = [summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
        events.add_summary(summary(value=values), step)
        self._logged.update(metrics)
        self._last_step = max(self._last_step, step)

    def log_hyperparams(self, params: Any, metrics: Optional[Mapping[str, float]] = None) -> None:
        """HParams: the run's settings beside its final metrics, in the same event file, once at the end. The user's
        own calls (without `metrics`) add their params to the settings written then: TensorBoard shows one HParams
        record per run."""
        if metrics is None:
            self._params.update(flat_params(params))
            return
        from torch.utils.tensorboard.summary import hparams

        flat = {k: _hparam_value(v) for k, v in {**params, **self._params}.items()}
        for summary in hparams(flat, dict(metrics)):
            self.events.add_summary(summary)
        # HParams reads each metric from the scalar series of that name. Series already logged end with
        # the final value; writing it again at step 0 would draw a line back to the start.
        unlogged = {name: value for name, value in metrics.items() if name not in self._logged}
        if unlogged:
            self.log_metrics(unlogged, self._last_step)

    def log_image(self, name: str, image: Any, step: int, dataformats: str = "CHW") -> None:
        self.experiment.add_image(name, image, step, dataformats=dataformats)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        self.experiment.add_histogram(name, values, step)

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        self.experiment.add_figure(name, figure, step, close=False)

    def log_text(self, name: str, text: str, step: int) -> None:
        self.experiment.add_text(name, text, step)

    def finalize(self) -> None:
        if self._events is not None:
            self._events.close()


class _EventFileWriter:
    """What SummaryWriter writes through (torch's FileWriter's methods), into the logger's one event file."""

    def __init__(self, logger: TensorBoardLogger) -> None:
        self._logger = logger

    def get_logdir(self) -> str:
        return self._logger.log_dir

    def add_event(self, event: Any, step: Optional[int] = None, walltime: Optional[float] = None) -> None:
        event.wall_time = time.time() if walltime is None else walltime
        if step is not None:
            event.step = int(step)
        self._logger.events.write(event)

    def add_summary(self, summary: Any, global_step: Optional[int] = None, walltime: Optional[float] = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.add_event(Event(summary=summary), global_step, walltime)

    def add_graph(self, graph_profile: Any, walltime: Optional[float] = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, TaggedRunMetadata

        graph, stats = graph_profile
        self.add_event(Event(graph_def=graph.SerializeToString()), None, walltime)
        metadata = TaggedRunMetadata(tag="step1", run_metadata=stats.SerializeToString())
        self.add_event(Event(tagged_run_metadata=metadata), None, walltime)

    def add_onnx_graph(self, graph: Any, walltime: Optional[float] = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.add_event(Event(graph_def=graph.SerializeToString()), None, walltime)

    def flush(self) -> None:
        if self._logger._events is not None:
            self._logger._events.flush()

    def close(self) -> None:
        self.flush()  # the run's file stays open: the logger closes it at the run's end

    def reopen(self) -> None:
        pass


@functools.lru_cache(maxsize=None)
def _writer_class() -> type:
    """SummaryWriter whose file writer is the logger's event file (torch.utils.tensorboard imported at first use)."""
    from torch.utils.tensorboard import SummaryWriter

    class RunSummaryWriter(SummaryWriter):
        """TensorBoard's SummaryWriter, writing into the run's event file rather than a file of its own."""

        def __init__(self, logger: TensorBoardLogger) -> None:
            self._logger = logger
            super().__init__(log_dir=logger.log_dir, flush_secs=logger.flush_secs)

        def _get_file_writer(self) -> Any:
            if self.file_writer is None:
                self.file_writer = _EventFileWriter(self._logger)
                self.all_writers = {self._logger.log_dir: self.file_writer}
            return self.file_writer

    return RunSummaryWriter
