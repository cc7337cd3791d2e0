"""The interface every checkpoint IO implements, and the error it raises."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint could not be found, read or written; the message names the path."""


class CheckpointIO(ABC):
    """Saves, loads and removes checkpoint dicts at file paths."""

    @abstractmethod
    def save_checkpoint(
        self, checkpoint: dict, path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        """Write `checkpoint` to `path`, replacing any previous file there."""

    @abstractmethod
    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = "cpu") -> dict:
        """Read the checkpoint dict stored at `path`."""

    @abstractmethod
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at `path` if it exists."""

    def wait(self) -> None:
        """Return once every checkpoint saved so far is on disk (plain file IO writes before returning)."""

    def teardown(self) -> None:
        """Release threads or handles; plain file IO holds none."""
