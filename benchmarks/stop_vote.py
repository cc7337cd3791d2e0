"""The per-step stop vote's cost: DDP steps with and without it, in the same two gloo processes, alternated.

Each optimizer step the loop starts a one-number MAX all-reduce of the stop signal (`Strategy.start_any_signal`)
and reads the one the previous step started, so that a signal stops every rank within two steps. Here the
benchmark's job (compare.py's JOB) trains under `strategy=ddp` on 2 CPU processes, and blocks of `--steps`
calls of each variant alternate, the order rotating each round:

  * step: `Loop._train_step([batch])`, what a step costs without the vote;
  * step + vote: the same, then `Loop.stop_vote()`, as `Loop._after_step` calls it every step.

    OMP_NUM_THREADS=1 python benchmarks/stop_vote.py --rounds 40 --steps 20
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare import JOB  # noqa: E402
from lm_step_costs import HEADER, alternate, batches, runner_loop, summary  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=40, help="rounds; each runs one block of both variants")
    p.add_argument("--steps", type=int, default=20, help="training steps per block")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def ddp_config():
    from hydra import compose, initialize_config_dir

    from runner.config import register_configs, register_resolvers

    register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "runner" / "conf"), version_base="1.3"):
        return compose("config", overrides=[*JOB, "accelerator=cpu", "strategy=ddp", "trainer.devices=2",
                                            "trainer.log_every_n_steps=50", "data.num_samples=8192"])


def worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(args.threads)
    from runner import instantiate as build

    cfg = ddp_config()
    strategy = build.build_strategy(cfg)
    strategy.setup_environment()
    loop, loader = runner_loop(cfg, strategy)
    data = batches(loader, 8)
    cursor = [0]

    def step() -> None:
        loop._train_step([data[cursor[0] % len(data)]])
        cursor[0] += 1

    def step_and_vote() -> None:
        step()
        loop.stop_vote()

    times = alternate({"step": step, "step + vote": step_and_vote}, args.rounds, args.steps,
                      {"CPU": time.thread_time, "wall": time.perf_counter}, sync=lambda: (loop.stop_vote.drain(),
                                                                                          dist.barrier()))
    if rank == 0:
        queue.put(summary(times["CPU"], 1e3, "thread CPU, ms (rank 0)") + summary(times["wall"], 1e3, "wall, ms (rank 0)"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"torch threads {args.threads}; {args.rounds} rounds; {args.steps} steps per block; "
          f"load {os.getloadavg()}\n", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=3600)
    for proc in procs:
        proc.join(timeout=120)
    print("\n".join([*HEADER, *rows]), flush=True)
    print(f"\nload {os.getloadavg()}")


if __name__ == "__main__":
    main()
