"""Checkpoint IO that writes on a background thread while training continues."""

from __future__ import annotations

import copy
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from runner.checkpoint_io.base import CheckpointError, CheckpointIO
from runner.checkpoint_io.torch_io import TorchCheckpointIO

_IMMUTABLE = (bool, int, float, complex, str, bytes, type(None))


class AsyncCheckpointIO(CheckpointIO):
    """Snapshots the checkpoint to CPU on the caller's thread, then writes it on one worker thread."""

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self._lock = threading.Lock()
        self._error: tuple[str, Exception] | None = None

    def save_checkpoint(
        self, checkpoint: dict, path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        self._raise_pending()
        # The copy must finish before returning: the next optimizer step updates tensors in place.
        snapshot = _snapshot(checkpoint)
        if self._executor is None:
            # One worker, so writes land in call order and the last save to a path wins.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-io")
        self._last = self._executor.submit(self._write, snapshot, os.fspath(path), storage_options)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = "cpu", **options: Any) -> dict:
        self.wait()
        return self.checkpoint_io.load_checkpoint(path, map_location=map_location, **options)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        self.wait()
        self.checkpoint_io.remove_checkpoint(path)

    def wait(self) -> None:
        """Block until every submitted write is done; raise the first error among them."""
        self._drain()
        self._raise_pending()

    def teardown(self) -> None:
        self._drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.checkpoint_io.teardown()
        self._raise_pending()

    def _write(self, snapshot: dict, path: str, storage_options: Any) -> None:
        try:
            self.checkpoint_io.save_checkpoint(snapshot, path, storage_options)
        except Exception as err:
            # Kept for the caller's thread: an exception left inside a Future is never seen.
            with self._lock:
                if self._error is None:
                    self._error = (path, err)

    def _drain(self) -> None:
        # The single worker runs writes in order, so the last one finishing means all have.
        if self._last is not None:
            self._last.result()
            self._last = None

    def _raise_pending(self) -> None:
        with self._lock:
            pending, self._error = self._error, None
        if pending is None:
            return
        path, err = pending
        if isinstance(err, CheckpointError):
            raise CheckpointError(f"background checkpoint write failed: {err}") from err
        raise CheckpointError(
            f"cannot write checkpoint {path} in the background: {type(err).__name__}: {err}"
        ) from err


def _snapshot(obj: Any) -> Any:
    """Copy containers and tensors (to CPU); immutable leaves are shared, anything else deep-copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, _IMMUTABLE):
        return obj
    if isinstance(obj, dict):
        out = obj.copy()  # keeps OrderedDict and other dict types
        for key, value in obj.items():
            out[key] = _snapshot(value)
        return out
    if isinstance(obj, list):
        return [_snapshot(value) for value in obj]
    if isinstance(obj, tuple):
        items = [_snapshot(value) for value in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)
