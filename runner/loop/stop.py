"""The stop vote: every process stops at the same step after any of them got a stop signal.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the worker installs the
signal handlers and hands `requested`, the loop asks the vote once per step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


class ReadCut(BaseException):
    """A stop signal came while the loop waited for its training data, and the read did not end in time: the loop
    stops where it stands (raised in the loop's thread by the worker's signal handling). A BaseException, as
    KeyboardInterrupt is, so that no handler of the data's errors takes it for one."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


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


class BatchVote:
    """An evaluation's stop (validation, test, predict): the processes agree at a batch every one of them reaches.

    Their shares can differ by a batch (every sample once, no padding), so the votes run over the batches all of
    them have, counted in one reduction at the start; a stream that does not say its length gets no vote before
    its end. As StopVote, each vote is read at the next batch; `final` agrees once more after the last batch.
    """

    def __init__(self, strategy: Any, requested: Callable[[], int], batches: float) -> None:
        import math

        import torch

        self.strategy, self.requested, self._pending = strategy, requested, None
        if strategy.world_size == 1:
            self.common = math.inf
        else:
            mine = torch.tensor(-1 if batches == math.inf else int(batches), dtype=torch.int64)
            self.common = max(0, int(strategy.all_reduce(mine, reduce_op="min")))  # -1: some process cannot say

    def __call__(self, index: int) -> int:
        """Before batch `index`: the signal some process got, once all of them know (0: go on)."""
        if self.strategy.world_size == 1:
            return int(self.requested())
        if index >= self.common:
            return 0
        agreed = self._drain()
        if not agreed:
            self._pending = self.strategy.start_any_signal(int(self.requested()))
        return agreed

    def final(self) -> int:
        """After the last batch: whether a signal came to any process before all of them got here."""
        if self.strategy.world_size == 1:
            return int(self.requested())
        return self._drain() or self.strategy.start_any_signal(int(self.requested()))()

    def _drain(self) -> int:
        pending, self._pending = self._pending, None
        return pending() if pending is not None else 0
