"""Where the data ends: an epoch's end agreed by every process, and what the processes read checked to be one order.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the loop asks `EpochEnd` for each
step's micro-batches and `check_stream_reads` after an evaluation over a stream.

A set or a stream that says its length ends its epoch where the plan says (each process checks its own data against
that length as it reads it). A training stream of unknown length ends where it ends: on several processes they agree
on that at every step (one small all-reduce), so that every process ends the epoch at the same global batch, and
processes whose streams end at different batches are named at the first step one of them has no batch for.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Optional

from runner.errors import DataError
from runner.loop.even import gathered


class EpochEnd:
    """The micro-batches of each optimizer step of an epoch, or None when the epoch's data has ended (on every
    process at once)."""

    def __init__(self, strategy: Any, schedule: Any, what: str) -> None:
        self.strategy, self.what = strategy, what
        self.planned = schedule.batches_per_epoch != math.inf
        self.accumulate = schedule.accumulate
        self.agree = not self.planned and strategy.world_size > 1

    def window(self, batches: Iterator[Any], epoch: int, batch: int) -> Optional[list]:
        """The next `accumulate` micro-batches of `batches`, this process's `batch`-th on, or None at the end."""
        window = list(itertools.islice(batches, self.accumulate))
        full = len(window) == self.accumulate
        if self.planned and not full:
            raise DataError(f"{self.what} gave {batch + len(window)} batch(es) in epoch {epoch} on rank "
                            f"{self.strategy.global_rank}, fewer than its length promised: its len() must count what "
                            "it yields")
        if self.agree:
            ended = gathered(self.strategy, int(not full))
            if any(ended) and not all(ended):
                raise DataError(self._differ(ended, epoch, batch))
        return window if full else None

    def _differ(self, ended: list[int], epoch: int, batch: int) -> str:
        short = [rank for rank, flag in enumerate(ended) if flag]
        more = [rank for rank, flag in enumerate(ended) if not flag]
        return (f"{self.what}: the processes' streams end at different points: in epoch {epoch}, after "
                f"{batch // self.accumulate} optimizer steps, rank(s) {_ranks(short)} have no batch left and rank(s) "
                f"{_ranks(more)} have more; every process must read the same stream (the data must not depend on "
                "the rank)")


def empty_epoch(what: str, epoch: int, steps_before: int, saved: str) -> DataError:
    """An epoch that gave no optimizer step: a stream read once (its __iter__ hands back the same iterator), or one
    that ran dry."""
    return DataError(f"{what} yielded no batch in epoch {epoch} (the run had taken {steps_before} optimizer steps): "
                     "a stream must start a new pass each time it is iterated (an __iter__ that returns the same "
                     f"iterator or generator is read once); {saved}")


def check_stream_reads(strategy: Any, loader: Any, prefix: str) -> None:
    """After an evaluation over a stream of unknown length: every process read as many of its samples (the same
    stream, read to the same point); one all-reduce. Every process calls it."""
    share = getattr(loader, "share", None)  # the stream a runner loader reads (runner.data.loaders.Loader)
    if share is None or strategy.world_size < 2:
        return
    reads = gathered(strategy, share.read)
    if len(set(reads)) > 1:
        counts = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(reads))
        raise DataError(f"{share.what}: the processes' streams end at different points in this {prefix} pass "
                        f"(samples read by {counts}); every process must read the same stream (the data must not "
                        "depend on the rank)")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
