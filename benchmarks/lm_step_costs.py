"""Where the LM step's time goes: the runner's `Loop.train_step` on experiment=charlm against handwritten_lm.py's step.

compare.py's `lm` suite times whole runs, which a shared machine disturbs by more than the 3 % at stake. This
script times the same steps in-process, on the experiment's model (conf/experiment/charlm.yaml, composed
through the runner's own config groups) and the same batches of its data, alternating the variants:

  * bookkeeping (1 process): what the runner's step does beyond forward, backward and the optimizer's
    arithmetic. First both whole steps on a tiny model (embedding 256 x 8, linear 8 -> 256) and a (2, 8)
    batch, so that what remains is the loop's own work: `Loop.train_step` (the task module, StepWeights,
    stats, sums, scheduler) against handwritten_lm.py's step. Then the runner's pieces one at a time on the
    experiment's (32, 128) batch: `LanguageModelTask.units`, `StepWeights.start` (the token count,
    `torch.full`, `start_all_reduce`), `scale()` and the loss times it, the token count and `stats_row` of
    `LanguageModelTask.score`, `TrainStep.accumulate`, `scheduler.step`; and the hand-written count and
    `TrainMeter.update` beside them. Microseconds per call, thread CPU time;
  * step (1 process): `Loop.train_step([batch])` against handwritten_lm.py's step (forward, loss,
    backward, AdamW step, zero_grad, sums), in blocks of `--steps` steps, rounds alternating which goes
    first; thread CPU time and wall time per step, and per round the ratio runner / hand;
  * step (2 gloo processes, DDP): the same two steps in two spawned processes; the runner's with the token
    count all-reduced while the forward pass runs (`DDPStrategy.start_all_reduce`), the hand-written one
    with a blocking `dist.all_reduce` first. Wall time and the training thread's CPU time per block, every
    block after a barrier (gloo communicates on threads of its own).

    OMP_NUM_THREADS=1 python benchmarks/lm_step_costs.py --rounds 80 --steps 1   # ~10 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from handwritten_lm import TrainMeter, token_loss  # noqa: E402

IGNORE = -100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--rounds", type=int, default=12, help="rounds; each runs one block of every variant")
    p.add_argument("--steps", type=int, default=4, help="training steps per block")
    p.add_argument("--calls", type=int, default=2000, help="calls per block of the bookkeeping pieces")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def lm_config(procs: int):
    """experiment=charlm composed through the runner's config groups, as `python -m runner` composes it."""
    from hydra import compose, initialize_config_dir

    from runner.config import register_configs, register_resolvers

    register_resolvers()
    register_configs()
    strategy = "ddp" if procs > 1 else "single"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["experiment=charlm", "accelerator=cpu", f"strategy={strategy}",
                                            f"trainer.devices={procs}", "trainer.log_every_n_steps=50"])


def runner_loop(cfg, strategy):
    """A `runner.loop.Loop` built the way runner.worker builds it, and its data."""
    from runner import build
    from runner.data import train_loader
    from runner.loggers import NullLogger
    from runner.loop import Loop
    from runner.tasks import TaskModule

    torch.manual_seed(cfg.trainer.seed)
    model = build.build_model(cfg)
    task = TaskModule(model, build.build_task(cfg), strategy.precision)
    strategy.module_to_device(task)
    wrapped = strategy.setup_module(task)
    optimizer = build.build_optimizer(cfg, model.parameters())
    data = build.build_data(cfg)
    loader = train_loader(data, strategy.distributed_sampler_kwargs, cfg.trainer.seed)
    loop = Loop(strategy, task, wrapped, optimizer, build.build_scheduler(cfg, optimizer), loader, None,
                NullLogger(), cfg.trainer, Path(tempfile.mkdtemp()), lambda: False, {})
    loop.train_log.tick = time.perf_counter()
    return loop, loader


def hand_step(cfg, world: int) -> Callable[[tuple], None]:
    """handwritten_lm.py's step (`train_epoch`'s body) on its own model and AdamW."""
    from torch.nn.parallel import DistributedDataParallel

    from runner.examples.charlm import CharTransformer

    torch.manual_seed(cfg.trainer.seed)
    m = cfg.model
    model = CharTransformer(vocab_size=m.vocab_size, block_size=m.block_size, d_model=m.d_model,
                            n_layers=m.n_layers, n_heads=m.n_heads)
    net = DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    meter = TrainMeter(torch.device("cpu"), world, None)

    def step(batch: tuple) -> None:
        x, y = batch
        tokens = (y != IGNORE).sum()
        count = tokens.float()
        if world > 1:
            dist.all_reduce(count)
        loss_sum = token_loss(net(x), y, IGNORE)
        (loss_sum * world / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.update(len(y), tokens, loss_sum)

    return step


def batches(loader, count: int) -> list:
    it = iter(loader)
    return [next(it) for _ in range(count)]


def alternate(variants: dict[str, Callable[[], None]], rounds: int, calls: int, clocks: dict[str, Callable[[], float]],
              sync: Callable[[], None] = lambda: None) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of each variant by clock, per round; each round runs every variant once, the order
    rotating from round to round. -> clock -> variant -> [per round]."""
    out = {clock: {name: [] for name in variants} for clock in clocks}
    names = list(variants)
    for name in names:  # warm-up: allocator, lazy imports, the optimizer's state
        for _ in range(3):
            variants[name]()
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            sync()
            start = {clock: read() for clock, read in clocks.items()}
            for _ in range(calls):
                variants[name]()
            for clock, read in clocks.items():
                out[clock][name].append((read() - start[clock]) / calls)
    return out


def summary(per_round: dict[str, list[float]], unit: float, label: str, compare: bool = True) -> list[str]:
    """Rows: median (min-max) per variant, and (`compare`) the per-round ratio and difference to the first."""
    names = list(per_round)
    first = per_round[names[0]]
    rows = []
    for name in names:
        v = [x * unit for x in per_round[name]]
        row = f"| {name} | {label} | {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
        if name == names[0] or not compare:
            row += " | - | - |"
        else:
            ratio = [a / b for a, b in zip(per_round[name], first)]
            delta = [(a - b) * unit for a, b in zip(per_round[name], first)]
            row += (f" | {statistics.median(ratio):.4f} ({min(ratio):.4f}-{max(ratio):.4f})"
                    f" | {statistics.median(delta):+.1f} ({min(delta):+.1f}-{max(delta):+.1f}) |")
        rows.append(row)
    return rows


HEADER = ["| variant | clock | per step, median (min-max) | ratio to the first, per round | difference, per round |",
          "|---|---|---|---|---|"]


def tiny_model() -> torch.nn.Module:
    """A model whose forward, backward and AdamW step take a few microseconds: what remains is bookkeeping."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))


def bookkeeping(args: argparse.Namespace, cfg) -> list[str]:
    """The step's cost beyond forward, backward and the optimizer's arithmetic: both steps on a tiny model and a
    (2, 8) batch, then the runner's own pieces one by one on the experiment's (32, 128) batch."""
    from runner.data import Batch
    from runner.strategies import SingleDeviceStrategy
    from runner.loop import TrainStep
    from runner.tasks.base import split_batch, stats_row

    # scheduler.step is timed alone below, without optimizer steps, which torch warns about.
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
    # Both steps, tiny model: the runner's Loop with the tiny model in place of CharTransformer.
    loop, loader = runner_loop(cfg, SingleDeviceStrategy())
    from runner.tasks import TaskModule

    model = tiny_model()
    loop.task = loop.wrapped = TaskModule(model, loop.task.task, loop.precision)
    loop.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    loop.scheduler = torch.optim.lr_scheduler.ConstantLR(loop.optimizer, factor=1.0, total_iters=0)
    loop.train_step = TrainStep(loop.strategy, loop.task, loop.wrapped, loop.optimizer, loop.scheduler, loop.metrics,
                                loader.batch_size, 1, cfg.trainer)
    hand_model = tiny_model()
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    meter = TrainMeter(torch.device("cpu"), 1, None)
    g = torch.Generator().manual_seed(0)
    tiny = Batch((torch.randint(0, 256, (2, 8), generator=g), torch.randint(0, 256, (2, 8), generator=g)))

    def hand() -> None:  # handwritten_lm.py's step, world = 1
        x, y = tiny
        tokens = (y != IGNORE).sum()
        count = tokens.float()
        loss_sum = token_loss(hand_model(x), y, IGNORE)
        (loss_sum * 1 / count).backward()
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)
        meter.update(len(y), tokens, loss_sum)

    variants = {"tiny-model step: hand-written": hand, "tiny-model step: runner Loop.train_step": lambda: loop.train_step([tiny])}
    rows = summary(alternate(variants, args.rounds, args.calls // 4, {"CPU": time.thread_time})["CPU"], 1e6,
                   "thread CPU, us")

    # The runner's pieces on the experiment's batch (each alone; the first row is the hand-written count).
    full, _ = runner_loop(cfg, SingleDeviceStrategy())
    batch = batches(loader, 1)[0]
    y = batch[1]
    task, weights = full.task.task, full.train_step.weights
    leaf = torch.tensor(3.0, requires_grad=True)
    loss = leaf * 1.0  # a non-leaf scalar, as the cross-entropy sum is
    out = {"stats": stats_row(len(y), (y != IGNORE).sum(), loss)}
    scale = weights.start([batch])
    pieces = {
        "piece: hand-written token count, (y != -100).sum().float()": lambda: (y != IGNORE).sum().float(),
        "piece: LanguageModelTask.units (split_batch, count, int)": lambda: task.units(batch),
        "piece: StepWeights.start (units, torch.full, start_all_reduce)": lambda: weights.start([batch]),
        "piece: scale() and loss * scale": lambda: loss * scale(),
        "piece: split_batch": lambda: split_batch(batch, "labels", "language_model"),
        "piece: token count in score + stats_row": lambda: stats_row(len(y), (y.reshape(-1) != IGNORE).sum(), loss),
        "piece: TrainStep.accumulate": lambda: full.train_step.accumulate(out),
        "piece: hand-written TrainMeter.update": lambda: meter.update(len(y), out["stats"][0, 1], loss),
        "piece: scheduler.step (ConstantLR)": full.scheduler.step,
    }
    rows += summary(alternate(pieces, args.rounds, args.calls, {"CPU": time.thread_time})["CPU"], 1e6,
                    "thread CPU, us", compare=False)
    return rows


def step_variants(label: str, hand: Callable[[tuple], None], loop, data: list) -> dict[str, Callable[[], None]]:
    """The hand-written step and the runner's, each walking its own cursor over the same batches."""
    cursor = {"hand": 0, "runner": 0}

    def feed(name: str, run: Callable[[tuple], None]) -> Callable[[], None]:
        def call() -> None:
            run(data[cursor[name] % len(data)])
            cursor[name] += 1
        return call

    return {f"step, {label}: hand-written": feed("hand", hand),
            f"step, {label}: runner Loop.train_step": feed("runner", lambda b: loop.train_step([b]))}


def step_one(args: argparse.Namespace, cfg) -> list[str]:
    from runner.strategies import SingleDeviceStrategy

    loop, loader = runner_loop(cfg, SingleDeviceStrategy())
    hand = hand_step(cfg, 1)
    variants = step_variants("1 process", hand, loop, batches(loader, 8))
    times = alternate(variants, args.rounds, args.steps, {"CPU": time.thread_time, "wall": time.perf_counter})
    return summary(times["CPU"], 1e3, "thread CPU, ms") + summary(times["wall"], 1e3, "wall, ms")


def join_group(rank: int, port: int, threads: int) -> None:
    """The environment a launched worker has, for rank `rank` of 2 meeting on `port`."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(threads)


def report(times: dict, rank: int, queue) -> None:
    """Rank 0 puts the CPU and wall rows on `queue`; then both leave the process group."""
    if rank == 0:
        queue.put(summary(times["CPU"], 1e3, "thread CPU, ms (rank 0)") + summary(times["wall"], 1e3, "wall, ms (rank 0)"))
    dist.barrier()
    dist.destroy_process_group()


def spawn_two(worker: Callable, args: argparse.Namespace) -> list[str]:
    """`worker(rank, port, args, queue)` in 2 spawned processes; the rows rank 0 puts on the queue."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, port, args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=3600)
    for proc in procs:
        proc.join(timeout=120)
    return rows


def ddp_worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    join_group(rank, port, args.threads)
    from runner import build

    cfg = lm_config(2)
    strategy = build.build_strategy(cfg)
    strategy.setup_environment()
    loop, loader = runner_loop(cfg, strategy)
    hand = hand_step(cfg, 2)
    variants = step_variants("2 DDP processes", hand, loop, batches(loader, 8))
    times = alternate(variants, args.rounds, args.steps, {"CPU": time.thread_time, "wall": time.perf_counter},
                      sync=dist.barrier)
    report(times, rank, queue)


def step_two(args: argparse.Namespace) -> list[str]:
    return spawn_two(ddp_worker, args)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    print(f"torch threads {args.threads}; {args.rounds} rounds; {args.steps} steps per block "
          f"({args.calls} calls for bookkeeping); load {os.getloadavg()}\n", flush=True)
    print("\n".join(HEADER), flush=True)
    if 1 in args.procs:
        cfg = lm_config(1)
        for rows in (bookkeeping(args, cfg), step_one(args, cfg)):
            print("\n".join(rows), flush=True)
    if 2 in args.procs:
        print("\n".join(step_two(args)), flush=True)
    print(f"\nload {os.getloadavg()}")


if __name__ == "__main__":
    main()
