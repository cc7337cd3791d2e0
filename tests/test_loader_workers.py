"""Loader worker processes end with the run, asked to stop while their loader is whole: freed by the cycle collector
instead, torch closes the loader's queues before it tells the workers, and waits 5 s for each one to give up."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from torch.utils.data import dataloader

import runner


@pytest.fixture
def shutdowns(monkeypatch: pytest.MonkeyPatch) -> list:
    """(worker processes, seconds torch took to end them) for each multi-process loader iterator ended."""
    ended: list = []
    shutdown = dataloader._MultiProcessingDataLoaderIter._shutdown_workers

    def timed(self) -> None:
        start, first = time.monotonic(), not self._shutdown
        shutdown(self)
        if first:
            ended.append((list(self._workers), time.monotonic() - start))

    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "_shutdown_workers", timed)
    return ended


def test_loader_workers_stop_at_once_when_fit_returns(make_cfg, tmp_path: Path, shutdowns) -> None:
    runner.fit(make_cfg("data.num_workers=2", "data.test_samples=32"), run_dir=tmp_path)
    assert len(shutdowns) == 3  # train, val and test, each ended before fit returned
    workers = [worker for started, _ in shutdowns for worker in started]
    assert len(workers) == 6 and [worker.exitcode for worker in workers] == [0] * 6
    # Each worker told to stop leaves in milliseconds; one that is never told is waited for 5 s, then let go.
    assert max(seconds for _, seconds in shutdowns) < 2.5
