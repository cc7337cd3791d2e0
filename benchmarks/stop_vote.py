"""The stop vote's cost: DDP steps with and without it, in the same two gloo processes, alternated.

A vote is a one-number MAX all-reduce of the stop signal (`Strategy.start_any_signal`) started at one step and read
at the next; since run 21 the processes vote every step only until they agree on an interval (runner.loop.stop),
then every k steps. Here the benchmark's job (compare.py's JOB) trains under `strategy=ddp` on 2 CPU processes, and
blocks of `--steps` calls of each variant alternate, the order rotating each round:

  * step: `Loop.train_step([batch])`, what a step costs without the vote;
  * step + vote every step: the same, then a `StopVote` held at one vote a step (what every run did before run 21);
  * step + vote: the same, then `Loop.stop_vote()`, as `Loop._after_step` calls it (its interval agreed after its
    first steps; `--steps` of 20 blocks give 10 steps a probe).

    OMP_NUM_THREADS=1 python benchmarks/stop_vote.py --rounds 40 --steps 20
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_step import job_config, run_two  # noqa: E402
from lm_step_costs import alternate, batches, join_group, report, runner_loop  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=40, help="rounds; each runs one block of both variants")
    p.add_argument("--steps", type=int, default=20, help="training steps per block")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    join_group(rank, port, args.threads)
    from runner import build
    from runner.loop.stop import StopVote

    cfg = job_config("ddp")
    strategy = build.build_strategy(cfg)
    strategy.setup_environment()
    loop, loader = runner_loop(cfg, strategy)
    data = batches(loader, 8)
    cursor = [0]

    def step() -> None:
        loop.train_step([data[cursor[0] % len(data)]])
        cursor[0] += 1

    every_step = StopVote(strategy, loop.stop_vote.requested)
    every_step.watch(lambda: False, "")  # a watched flag holds it at one vote a step

    def step_and_vote_every_step() -> None:
        step()
        every_step()

    def step_and_vote() -> None:
        step()
        loop.stop_vote()

    def between_blocks() -> None:  # no block inherits another's vote in flight
        every_step.drain()
        loop.stop_vote.drain()
        dist.barrier()

    times = alternate({"step": step, "step + vote every step": step_and_vote_every_step, "step + vote": step_and_vote},
                      args.rounds, args.steps, {"CPU": time.thread_time, "wall": time.perf_counter},
                      sync=between_blocks)
    if rank == 0:
        print(f"rank 0: the loop's vote agreed on {loop.stop_vote.interval} steps a vote", flush=True)
    report(times, rank, queue)


if __name__ == "__main__":
    run_two(worker, parse_args())
