"""The stop vote: every process stops at the same step after any of them got a stop signal.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the worker installs the
signal handlers and hands `requested`, the loop asks the vote once per step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


class StopVote:
    """Processes agree to stop at one step: each step starts a reduction of the signal each process got (0: none),
    read at the next step, so a stop comes at most two steps after the signal, whatever the log interval."""

    def __init__(self, strategy: Any, requested: Callable[[], int]) -> None:
        self.strategy, self.requested = strategy, requested
        self._pending: Optional[Callable[[], int]] = None

    def __call__(self) -> int:
        """The signal some process got (the highest number when several), once every process knows it."""
        if self.strategy.world_size == 1:
            return int(self.requested())
        agreed = self.drain()
        if not agreed:
            self._pending = self.strategy.start_any_signal(int(self.requested()))
        return agreed

    def drain(self) -> int:
        pending, self._pending = self._pending, None
        return pending() if pending is not None else 0
