"""strategy=fsdp's step against a hand-written FSDP2 step, in the same two gloo processes, alternated.

compare.py's `fsdp` suite times whole runs (`python -m runner strategy=fsdp` against `handwritten.py --fsdp`
under torchrun), which a shared machine disturbs by more than the 3 % at stake. Here both steps run in the
same two spawned processes on the benchmark's job (compare.py's JOB: MLP 64 -> 4 x 512 -> 10, SGD with
momentum, batch 64 per process), each model sharded as strategy=fsdp shards it by default (every Linear, then
the whole model), over the same batches:

  * runner: `Loop.train_step([batch])` of a Loop built as runner.worker builds it under FSDPStrategy;
  * hand-written: handwritten.py's step (forward, cross-entropy, backward, SGD step, zero_grad) on a
    `fully_shard`-ed `nn.Sequential` with the same layers.

Blocks of `--steps` steps, the order rotating each round, every block after a barrier; wall time and the
training thread's CPU time per step on rank 0, and per round the ratio runner / hand.

    OMP_NUM_THREADS=1 python benchmarks/fsdp_step.py --rounds 40 --steps 10
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare import JOB  # noqa: E402
from lm_step_costs import (HEADER, alternate, batches, join_group, report, runner_loop, spawn_two,  # noqa: E402
                           step_variants)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=40, help="rounds; each runs one block of both steps")
    p.add_argument("--steps", type=int, default=10, help="training steps per block")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def job_config(strategy: str = "fsdp"):
    """compare.py's job on 2 CPU processes under `strategy`, composed as `python -m runner` composes it."""
    from hydra import compose, initialize_config_dir

    from runner.config import register_configs, register_resolvers

    register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*JOB, "accelerator=cpu", f"strategy={strategy}", "trainer.devices=2",
                                            "trainer.log_every_n_steps=50", "data.num_samples=8192"])


def hand_step(cfg) -> Callable[[tuple], None]:
    """handwritten.py's step on its own model, sharded with fully_shard like strategy=fsdp's default."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import handwritten

    torch.manual_seed(cfg.trainer.seed)
    args = handwritten.parse_args(["--steps", "1", "--out", "unused"])
    model = handwritten.make_model(args)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.momentum)

    def step(batch: tuple) -> None:
        x, y = batch
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    join_group(rank, port, args.threads)
    from runner import build

    cfg = job_config("fsdp")
    strategy = build.build_strategy(cfg)
    strategy.setup_environment()
    loop, loader = runner_loop(cfg, strategy)
    variants = step_variants("2 FSDP processes", hand_step(cfg), loop, batches(loader, 8))
    times = alternate(variants, args.rounds, args.steps, {"CPU": time.thread_time, "wall": time.perf_counter},
                      sync=dist.barrier)
    report(times, rank, queue)


def run_two(worker: Callable, args: argparse.Namespace) -> None:
    """`worker(rank, port, args, queue)` in 2 spawned processes; print the table rank 0 reports."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(f"torch threads {args.threads}; {args.rounds} rounds; {args.steps} steps per block; "
          f"load {os.getloadavg()}\n", flush=True)
    rows = spawn_two(worker, args)
    print("\n".join([*HEADER, *rows]), flush=True)
    print(f"\nload {os.getloadavg()}")


def main() -> None:
    run_two(worker, parse_args())


if __name__ == "__main__":
    main()
