"""Checkpoint IO plugins: how a checkpoint dict reaches the disk and comes back."""

from runner.checkpoint_io.async_io import AsyncCheckpointIO
from runner.checkpoint_io.base import CheckpointError, CheckpointIO
from runner.checkpoint_io.torch_io import TorchCheckpointIO

__all__ = ["AsyncCheckpointIO", "CheckpointError", "CheckpointIO", "TorchCheckpointIO"]
