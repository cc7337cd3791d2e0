"""Evaluation batches evened out over the processes, for strategies whose forward is a collective.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the loop's evaluation takes its
batches through `even_batches`. Under FSDP each forward all-gathers the parameters of every unit, so a process
that ran out of batches would leave the others waiting in their next forward. Shares of a validation set differ by
a batch (every sample counted once, no padding samples), so the processes with fewer run padding forwards whose
outputs the loop discards: the metrics are those of the real batches alone.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterable, Iterator

import torch

_END = object()


def even_batches(strategy: Any, batches: Iterable, count: float) -> Iterable[tuple[Any, bool]]:
    """(batch, real) pairs: this process's first `count` batches (math.inf: all of a stream that does not say), then padding
    forwards until every process has run as many as the one with the most. Agreed in one all-reduce when every
    process knows its count, else with one per batch. Nothing is agreed where forwards are not collectives."""
    batches = batches if count == math.inf else itertools.islice(batches, int(count))
    if strategy.world_size == 1 or not strategy.collective_forward:
        return ((batch, True) for batch in batches)
    counts = gathered(strategy, -1 if count == math.inf else int(count))
    if min(counts) < 0:
        return _voted(strategy, iter(batches))
    return _counted(strategy, batches, counts)


def gathered(strategy: Any, value: int) -> list[int]:
    """Every process's `value`, by rank (one all-reduce of a vector holding each in its own place)."""
    values = torch.zeros(strategy.world_size, dtype=torch.int64, device=strategy.root_device)
    values[strategy.global_rank] = value
    return [int(v) for v in strategy.all_reduce(values, reduce_op="sum").tolist()]


def _counted(strategy: Any, batches: Iterable, counts: list[int]) -> Iterator[tuple[Any, bool]]:
    """Known counts: this process's batches, then its last one again until the most any process has."""
    most, rank = max(counts), strategy.global_rank
    batches, template, done = iter(batches), None, 0
    if min(counts) == 0 < most:  # a process without a batch pads with one the process with the most sends
        source = counts.index(most)
        first = next(batches) if rank == source else None
        template = strategy.broadcast(first, src=source)
        batches = itertools.chain([first], batches) if rank == source else batches
    for batch in batches:
        template, done = batch, done + 1
        yield batch, True
    for _ in range(most - done):
        yield template, False


def _voted(strategy: Any, batches: Iterator) -> Iterator[tuple[Any, bool]]:
    """Unknown counts: before each forward the processes say whether they have a batch (bit 1) and whether,
    having none, they lack one to pad with (bit 2); they stop when none has one."""
    template = None
    while True:
        batch = next(batches, _END)
        has = batch is not _END
        flags = gathered(strategy, int(has) + 2 * int(not has and template is None))
        if not any(flag & 1 for flag in flags):
            return
        if any(flag & 2 for flag in flags):
            source = next(rank for rank, flag in enumerate(flags) if flag & 1)
            sent = strategy.broadcast(batch if strategy.global_rank == source else None, src=source)
            template = template if has or template is not None else sent
        if has:
            template = batch
            yield batch, True
        else:
            yield template, False
