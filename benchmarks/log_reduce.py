"""What reducing the metric sums at every step costs 2 DDP processes: blocking, or waited for one step later.

Two gloo processes train the benchmark's MLP (64 -> 4 x 512 -> 10, batch 64 each, SGD) on fixed batches,
in blocks of steps alternated round by round: metric sums accumulated on the device only ("none"), reduced
over both processes and read back at every step ("blocking": `DDPStrategy.all_reduce` + `tolist`, as the
loop did before), or reduced while the next step trains ("async": `DDPStrategy.start_all_reduce`, read one
step later, as the loop does now). Per round, each variant's per-step wall time over "none"'s.

    OMP_NUM_THREADS=1 python benchmarks/log_reduce.py --rounds 12 --steps 100
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from runner.strategies import DDPStrategy

VARIANTS = ("none", "blocking", "async")


def block(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, steps: int, variant: str,
          strategy: DDPStrategy) -> float:
    """Seconds for `steps` training steps with the given way of reducing the sums."""
    inputs, targets = batch
    sums = torch.zeros(3, dtype=torch.float64)
    pending = None
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        out = model(inputs)
        loss = nn.functional.cross_entropy(out, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sums += torch.stack([loss.detach().double() * len(targets), torch.tensor(float(len(targets))),
                             (out.argmax(1) == targets).sum().double()])
        if variant == "blocking":
            strategy.all_reduce(sums, reduce_op="sum").tolist()
            sums.zero_()
        elif variant == "async":
            if pending is not None:
                pending().tolist()
            pending = strategy.start_all_reduce(sums, reduce_op="sum")
            sums.zero_()
    if pending is not None:
        pending().tolist()
    return time.perf_counter() - start


def worker(rank: int, port: int, args: argparse.Namespace, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, 512), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers, nn.Linear(512, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    batch = (torch.randn(64, 64, generator=generator), torch.randint(0, 10, (64,), generator=generator))
    strategy = DDPStrategy()
    for variant in VARIANTS:  # warm-up
        block(model, optimizer, batch, 20, variant, strategy)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]  # each variant first in turn
        for variant in order:
            times[variant].append(block(model, optimizer, batch, args.steps, variant, strategy) / args.steps)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=100, help="steps per block")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    times = queue.get(timeout=1800)
    for proc in procs:
        proc.join(timeout=60)
    print(f"2 gloo processes, {args.rounds} rounds x {args.steps} steps per variant, load {os.getloadavg()}")
    for variant in VARIANTS:
        per_step = times[variant]
        line = f"{variant:>9}: {statistics.median(per_step) * 1e3:7.3f} ms/step (min {min(per_step) * 1e3:.3f}, " \
               f"max {max(per_step) * 1e3:.3f})"
        if variant != "none":
            over = [a / b - 1 for a, b in zip(per_step, times["none"])]
            line += f"  over none: median {statistics.median(over) * 100:+.1f} % " \
                    f"(min {min(over) * 100:+.1f}, max {max(over) * 100:+.1f})"
        print(line)


if __name__ == "__main__":
    main()
