"""The stop vote between two real gloo processes: after their first steps they agree once on how many steps apart
they vote (the slowest process's choice), a signal on one of them still stops both at one step, and a stop some
process asks for (Lightning's should_stop) rides on the same votes, every step."""

from __future__ import annotations

import itertools
import signal
from typing import Any, Optional

import pytest
import torch

from _dist import run_ranks
from runner.environments import LocalEnvironment
from runner.loop.stop import MAX_INTERVAL, PROBE_STEPS, StopVote, interval_for
from runner.strategies import DDPStrategy

pytestmark = pytest.mark.xdist_group("stop_vote")


class Counted(DDPStrategy):
    """DDPStrategy that counts the votes it starts."""

    votes = 0

    def start_any_signal(self, signum: Any) -> Any:
        self.votes += 1
        return super().start_any_signal(signum)


def _vote(strategy: Counted, step_s: float, signal_at: int, flag_at: Optional[int] = None,
          steps: int = 60) -> dict[str, Any]:
    """`steps` steps of `step_s` seconds each by this process's clock; SIGTERM from step `signal_at` on (0: never),
    a watched flag (every process watches it, or none) set from step `flag_at` on (0: never). Returns where the
    processes agreed."""
    ticks = itertools.count()
    step = [0]
    stops: list[tuple[int, str]] = []
    vote = StopVote(strategy, lambda: signal.SIGTERM if signal_at and step[0] >= signal_at else 0,
                    on_stop=lambda reason: stops.append((step[0], reason)), clock=lambda: next(ticks) * step_s)
    if flag_at is not None:
        vote.watch(lambda: bool(flag_at) and step[0] >= flag_at, "asked")
    strategy.votes = 0
    agreed, votes_by_step = 0, []
    while step[0] < steps and not agreed and not stops:
        step[0] += 1
        agreed = vote()
        votes_by_step.append(strategy.votes)
    interval = vote.interval
    return {"step": step[0], "agreed": agreed, "final": vote.final(), "interval": interval, "stops": stops,
            "votes_by_step": votes_by_step}


def scenarios(rank: int) -> dict[str, Any]:
    strategy = Counted(parallel_devices=[torch.device("cpu")] * 2, cluster_environment=LocalEnvironment(), timeout=30)
    strategy.setup_environment()
    try:
        return {
            # rank 0's steps take 10 ms (8 steps a vote), rank 1's 30 ms (2): they agree on 2.
            "spread": _vote(strategy, 0.010 if rank == 0 else 0.030, signal_at=40 if rank == 1 else 0),
            "near_the_end": _vote(strategy, 0.001, signal_at=59 if rank == 0 else 0),
            "flag_on_one": _vote(strategy, 0.001, signal_at=0, flag_at=5 if rank == 1 else 0),
            "flag_on_both": _vote(strategy, 0.001, signal_at=0, flag_at=3),
        }
    finally:
        strategy.teardown()


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(scenarios, world_size=2, timeout=90)


def test_the_interval_suits_the_step_and_stays_within_bounds() -> None:
    assert interval_for(0.010) == MAX_INTERVAL and interval_for(0.030) == 2
    assert interval_for(0.5) == interval_for(0.0) == 1


def test_the_processes_agree_on_the_slowest_ones_interval_and_vote_that_far_apart(ranks: list[dict]) -> None:
    assert [rank["spread"]["interval"] for rank in ranks] == [2, 2]
    # Every step votes until the interval is agreed (the probe's steps and the read of their vote), then every 2nd.
    probe = PROBE_STEPS + 2
    assert [rank["spread"]["votes_by_step"][39] for rank in ranks] == [probe + (40 - probe) // 2] * 2


def test_a_signal_on_one_process_stops_both_at_one_step_within_the_interval(ranks: list[dict]) -> None:
    zero, one = (rank["spread"] for rank in ranks)
    assert zero["agreed"] == one["agreed"] == signal.SIGTERM
    assert zero["step"] == one["step"] and 40 <= zero["step"] <= 40 + 2 + 1


def test_a_signal_after_the_last_vote_is_agreed_at_the_end(ranks: list[dict]) -> None:
    zero, one = (rank["near_the_end"] for rank in ranks)
    assert zero["interval"] == one["interval"] == MAX_INTERVAL
    assert (zero["agreed"], one["agreed"]) == (0, 0) and zero["step"] == one["step"] == 60
    assert zero["final"] == one["final"] == signal.SIGTERM


def test_a_flag_set_on_one_process_stops_both_after_the_next_step(ranks: list[dict]) -> None:
    assert [rank["flag_on_one"]["stops"] for rank in ranks] == [[(6, "asked")], [(6, "asked")]]
    assert [rank["flag_on_one"]["interval"] for rank in ranks] == [1, 1]  # a watched flag: a vote every step


def test_a_flag_set_on_every_process_at_one_step_stops_them_at_that_step(ranks: list[dict]) -> None:
    assert [rank["flag_on_both"]["stops"] for rank in ranks] == [[(3, "asked")], [(3, "asked")]]
