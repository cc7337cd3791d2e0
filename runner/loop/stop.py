"""The stop vote: every process stops at the same step after any of them got a stop signal.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the worker installs the
signal handlers and hands `requested`, the loop asks the vote once per step.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional


class ReadCut(BaseException):
    """A stop signal came while the loop waited for its training data, and the read did not end in time: the loop
    stops where it stands (raised in the loop's thread by the worker's signal handling). A BaseException, as
    KeyboardInterrupt is, so that no handler of the data's errors takes it for one."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# How soon after a stop signal every process stops, at most: the votes' interval is chosen so that its steps take about
# this long, and it is never more than MAX_INTERVAL steps.
STOP_WITHIN_S = 0.1
MAX_INTERVAL = 8
# The steps timed before the processes agree on the interval (they vote at every one of them meanwhile); the first
# step, which warms up (its FLOP count, the first allocations), is not one of them.
PROBE_STEPS = 10


def interval_for(step_s: float) -> int:
    """Steps between votes for steps of `step_s` seconds: a stop comes at most interval + 1 steps after its signal."""
    if not step_s > 0:
        return 1
    return max(1, min(MAX_INTERVAL, int(STOP_WITHIN_S / step_s) - 1))


class StopVote:
    """Processes agree to stop at one step after any of them got a stop signal.

    A vote is one reduction of the signal each process got (0: none), started at one step and read at the next, so
    that no process waits for it. A collective every step costs a few per cent of a short step; so the processes
    time their first PROBE_STEPS steps, agree once on an interval k (the slowest process's, `interval_for`) in the
    last of those votes, and then vote every k steps: a stop comes at most k + 1 steps, about STOP_WITHIN_S, after
    its signal. `final` agrees once more at the end of the run.

    `watch(flag, reason)`: a stop some process asks for (Lightning's trainer.should_stop), carried by the same
    votes, which then come every step. Asked by every process at one step, the run stops at that step (those that
    asked read the vote at once); asked by some, every process stops at the next step. `on_stop(reason)` ends the
    run after its step (Loop.request_stop), on every process at the same step.
    """

    def __init__(self, strategy: Any, requested: Callable[[], int], on_stop: Callable[[str], None] = lambda _: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.strategy, self.requested, self.on_stop, self.clock = strategy, requested, on_stop, clock
        self.world_size = strategy.world_size
        self.interval = 1  # steps between votes; 1 until the processes agree on theirs
        self._pending: Optional[Callable[[], tuple[int, ...]]] = None
        self._calls = self._since = 0  # votes are read where (calls - since) % interval == 0
        self._times: Optional[list[float]] = []  # the probe's step ends (None once it is over)
        self._flags: list[tuple[Callable[[], Any], str]] = []
        self._stopped = False  # a watched flag has stopped the run

    def watch(self, flag: Callable[[], Any], reason: str) -> None:
        """Stop every process when `flag()` is true on some (checked after each step); every process calls it."""
        self._flags.append((flag, reason))
        self._times = None  # a flag must be read every step

    def __call__(self) -> int:
        """After each step: the signal some process got (the highest number when several), once every process knows
        it; 0 meanwhile."""
        if self.world_size == 1:
            self._asked(self._mine())
            return int(self.requested())
        self._calls += 1
        agreed = self._read() if (self._calls - self._since) % self.interval == 0 else 0
        if not agreed and not self._stopped and (self._calls - self._since) % self.interval == self.interval - 1:
            agreed = self._start()  # read at once only where every process asked to stop
        return agreed

    def final(self) -> int:
        """At the end of the run, on every process: a signal that came since the last vote, agreed (one process
        has read its signal at every step)."""
        if self.world_size == 1:
            return 0
        self.interval, self._times = 1, None
        return self._read() or self._start(wait=True)

    def drain(self) -> int:
        """The vote in flight, read now (every process calls it at the same point)."""
        return self._read() if self.world_size > 1 else 0

    def flags_now(self) -> None:
        """A vote of the watched flags alone, waited for, at a point every process reaches (the end of a validation
        in training): set on some process, every process stops after this point."""
        if self.world_size == 1 or not self._flags:
            self._asked(self._mine())
            return
        mine = int(self._mine())
        self._asked(bool(self.strategy.start_any_signal([0, 0, mine, -mine])()[2]))

    def _mine(self) -> bool:
        return not self._stopped and any(flag() for flag, _ in self._flags)

    def _proposal(self) -> int:
        """0, or in the probe's last vote this process's interval (the others' are reduced with it)."""
        if self._times is None:
            return 0
        self._times.append(self.clock())
        if len(self._times) < PROBE_STEPS + 2:  # the first call ends the warm-up step
            return 0
        durations = sorted(b - a for a, b in zip(self._times[1:], self._times[2:]))
        self._times = None
        return interval_for(durations[len(durations) // 2])

    def _start(self, wait: bool = False) -> int:
        """Start a vote: [signal, -interval proposed, a flag asked, -a flag asked] reduced by MAX gives the highest
        signal, the smallest interval proposed, and whether some and every process asked. A process that asked
        reads it at once: asked by every process, the run stops now; otherwise its result waits for its turn."""
        mine = self._mine()
        votes = self.strategy.start_any_signal([int(self.requested()), -self._proposal(), int(mine), -int(mine)])
        if mine or wait:
            result = tuple(votes())
            if result[3] == -1 and not wait:  # every process asked: all of them read it now
                self._asked(True)
                return self._agree(result)
            votes = lambda: result  # noqa: E731 - read at the read point, as every other process reads it
        self._pending = votes
        return self._read() if wait else 0

    def _read(self) -> int:
        pending, self._pending = self._pending, None
        return self._agree(tuple(pending())) if pending is not None else 0

    def _agree(self, result: tuple[int, ...]) -> int:
        signum, proposed, some = result[0], -result[1], result[2]
        if proposed:  # every process proposed in this vote: the smallest interval from here on
            self.interval, self._since = proposed, self._calls
        self._asked(bool(some))
        return int(signum)

    def _asked(self, some: bool) -> None:
        if some and not self._stopped:
            self._stopped = True
            self.on_stop(self._flags[0][1])


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
