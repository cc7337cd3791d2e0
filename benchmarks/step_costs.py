"""Where a training step's time goes: the runner's loop pieces against their hand-written equivalents, in one process.

compare.py times whole runs, whose wall time a shared machine disturbs by more than the few percent at
stake. This script times the pieces in-process instead, on the same model and batch, alternating the
variants in blocks of steps (A B C A B C ...) and reporting the median per step:

  * data: one batch from the runner's loader (`runner.data.train_loader`) against DataLoader(TensorDataset)
    with a DistributedSampler, as benchmarks/handwritten.py fetches it (CPU time of this thread);
  * step: `Loop.train_step` (forward, backward, optimizer, scheduler, metric sums) against the
    hand-written step of handwritten.py (CPU time of this thread);
  * logging: the loop's step alone, with a train log (`TrainLog.start`, then `collect`) after every step to a logger that does
    nothing, and to TensorBoard (wall time, and the CPU time of all the process's threads, which also
    counts work a logger hands to a thread of its own, as torch's SummaryWriter does).

    python benchmarks/compare.py ...            # whole runs
    python benchmarks/step_costs.py --blocks 30 # the pieces (CPU, one thread)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import JOB  # noqa: E402  (the benchmark's job, as runner overrides)
from handwritten import make_model  # noqa: E402

Clock = Callable[[], float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=30, help="blocks per variant (alternated)")
    p.add_argument("--steps", type=int, default=100, help="steps per block")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def runner_config(log_every: int = 50):
    """The benchmark job composed through the runner's own config groups (so new trainer keys come along)."""
    from hydra import compose, initialize_config_dir

    from runner.config import register_configs, register_resolvers

    register_resolvers()
    register_configs()
    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("config", overrides=[*JOB, "accelerator=cpu", "strategy=single", "trainer.devices=1",
                                            f"trainer.log_every_n_steps={log_every}", "data.num_samples=44800"])


def runner_loop(cfg, logger) -> object:
    """A `runner.loop.Loop` built from the composed config the way runner.worker builds it (one CPU process)."""
    from runner import build
    from runner.data import train_loader
    from runner.loop import Loop
    from runner.tasks import TaskModule

    strategy = build.build_strategy(cfg)
    torch.manual_seed(cfg.trainer.seed)
    model = build.build_model(cfg)
    task = TaskModule(model, build.build_task(cfg), strategy.precision)
    optimizer = build.build_optimizer(cfg, model.parameters())
    loader = train_loader(build.build_data(cfg), None, cfg.trainer.seed)
    loop = Loop(strategy, task, task, optimizer, build.build_scheduler(cfg, optimizer), loader, None, logger,
                cfg.trainer, Path(tempfile.mkdtemp()), lambda: False, {})
    loop.train_log.tick = time.perf_counter()
    return loop


def hand_step(args: argparse.Namespace) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """handwritten.py's step: forward, loss, backward, SGD step, zero_grad, metric sums as tensors."""
    torch.manual_seed(0)
    model = make_model(argparse.Namespace(num_features=64, hidden=512, depth=4, num_classes=10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sums = torch.zeros(3, dtype=torch.float64)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sums[0] += loss.detach() * len(y)
        sums[1] += (out.detach().argmax(1) == y).sum()
        sums[2] += len(y)

    return step


def alternate(variants: dict[str, Callable[[], None]], args: argparse.Namespace, clock: Clock) -> dict[str, float]:
    """Median seconds per call of each variant, over `--blocks` blocks of `--steps` calls, order alternating."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():  # warm-up: allocator, lazy imports, first TensorBoard event
        for _ in range(20):
            run()
    for block in range(args.blocks):
        items = list(variants.items())
        for name, run in items if block % 2 == 0 else items[::-1]:
            start = clock()
            for _ in range(args.steps):
                run()
            times[name].append((clock() - start) / args.steps)
    return {name: statistics.median(t) for name, t in times.items()}


def cycle(loader: DataLoader) -> Callable[[], object]:
    """next() over a loader, starting a new epoch when one ends (each epoch is 700 batches here)."""
    state = {"it": iter(loader)}

    def fetch() -> object:
        try:
            return next(state["it"])
        except StopIteration:
            state["it"] = iter(loader)
            return next(state["it"])

    return fetch


def data_costs(args: argparse.Namespace, cfg) -> dict[str, float]:
    from runner import build
    from runner.data import train_loader

    data = build.build_data(cfg)
    dataset = TensorDataset(data.train_dataset.inputs, data.train_dataset.targets)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    hand = DataLoader(dataset, batch_size=64, sampler=sampler, drop_last=True)
    variants = {"data: hand DataLoader(TensorDataset)": cycle(hand),
                "data: runner train_loader": cycle(train_loader(data, None, 0))}
    return alternate(variants, args, time.thread_time)


def step_costs(args: argparse.Namespace, cfg, batch: tuple) -> dict[str, float]:
    from runner.loggers import NullLogger

    loop, hand = runner_loop(cfg, NullLogger()), hand_step(args)
    variants = {"step: hand-written": lambda: hand(*batch),
                "step: runner Loop.train_step": lambda: loop.train_step([batch])}
    return alternate(variants, args, time.thread_time)


def logging_costs(args: argparse.Namespace, batch: tuple) -> tuple[dict[str, float], dict[str, float]]:
    from runner.loggers import NullLogger, TensorBoardLogger

    cfg = runner_config(log_every=1)
    plain, null, board = (runner_loop(cfg, logger) for logger in
                          (NullLogger(), NullLogger(), TensorBoardLogger(tempfile.mkdtemp())))

    def logged(loop) -> Callable[[], None]:
        return lambda: (loop.train_step([batch]), loop.train_log.start(), loop.train_log.collect())

    variants = {"loop step, no log": lambda: plain.train_step([batch]),
                "loop step + log, NullLogger": logged(null), "loop step + log, TensorBoard": logged(board)}
    # Wall time sees what the training thread waits for; process CPU time also counts any writer thread.
    result = {f"{name} (wall)": seconds for name, seconds in alternate(variants, args, time.perf_counter).items()}
    cpu = alternate(variants, args, time.process_time)
    board.logger.finalize()
    return result, {f"{name} (CPU, all threads)": seconds for name, seconds in cpu.items()}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = runner_config()
    batch = (torch.randn(64, 64), torch.randint(0, 10, (64,)))
    print(f"torch threads {args.threads}; {args.blocks} blocks x {args.steps} steps per variant\n")
    print("| variant | us per call, median | vs first of its group |\n|---|---|---|")
    for group in (data_costs(args, cfg), step_costs(args, cfg, batch), *logging_costs(args, batch)):
        first = next(iter(group.values()))
        for name, seconds in group.items():
            delta = f"{(seconds - first) * 1e6:+.1f} us ({seconds / first:.3f}x)"
            print(f"| {name} | {seconds * 1e6:.1f} | {delta} |", flush=True)


if __name__ == "__main__":
    main()
