"""What the Lightning adapter costs per training step: a LightningModule against the same network, loss, metric and
optimizer under `task=model`, both driven by the runner's own loop in one process, alternated.

The pair: `LitBench` is shaped like lightning-hydra-template's modules (a net, cross-entropy, a torchmetrics Accuracy
called on the batch; `self.log` of the loss tensor and of the Metric object each step; SGD from
configure_optimizers). `ModelBench` is the same computation as a plain module whose forward returns
`{"loss", "acc"}` for `task=model` (the runner's own "the model computes its loss" task, which also takes a
per-step scalar): same weights at the start (one seed, the same `runner.models.MLP` inside), same forward, same
Metric call, same SGD. Everything the two do differently is the adapter: the step called through LightningTask
(the recorder's `self.log`, the batch hooks, batch_idx, the Metric's batch value), the step's units learnt from
its output (gradients rescaled afterwards), and the Lightning hooks callback after each step. The script checks
that both end a log window with the same weights and the same logged train/loss and train/acc, so the pair did the
same arithmetic.

Each step is the loop's own per-step body (`Loop._run`'s: the step, `on_train_batch_end`, `_after_step` with a
train log every `--log-every` steps to a logger that does nothing), on one batch made once (data loading is the
same for both and left out). Per block of `--steps` steps (about 30 ms: the blocks of one round see the same
load on a shared CPU): this thread's CPU time and the wall time; rounds alternate A B C, C B A; the ratio is taken
per round.

    python benchmarks/lightning_step.py --json benchmarks/results/run19-lightning-step.json
    python benchmarks/lightning_step.py --pieces        # the adapter's extra pieces alone
    py-spy record --format raw -o lit.txt -- python benchmarks/lightning_step.py --only lightning --sizes small
    python benchmarks/lightning_step.py --spy-summary lit.txt   # the step's share in each piece
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics.classification.accuracy import Accuracy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # `lightning_step.LitBench` as a model._target_
from runner.models import MLP

SIZES = {  # name -> (in_features, hidden, depth, num_classes, batch_size)
    "small": (32, 64, 2, 10, 64),  # a fraction of a millisecond per step: the adapter's fixed cost shows most
    "mlp512": (64, 512, 4, 10, 64),  # compare.py's job: a few ms per step on this CPU
}


class LitBench(pl.LightningModule):
    """MNISTLitModule's training step on the runner's MLP: self.log of a tensor and of a torchmetrics Metric."""

    def __init__(self, in_features: int, hidden: int, depth: int, num_classes: int, lr: float = 0.01,
                 momentum: float = 0.9) -> None:
        super().__init__()
        self.net = MLP(in_features, hidden, depth, num_classes)
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.lr, self.momentum = lr, momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        self.train_acc(torch.argmax(logits, dim=1), y)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class ModelBench(nn.Module):
    """LitBench's step as a plain module for task=model: the loss and the Metric's batch value, returned."""

    def __init__(self, in_features: int, hidden: int, depth: int, num_classes: int) -> None:
        super().__init__()
        self.net = MLP(in_features, hidden, depth, num_classes)
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self.net(x)
        loss = self.criterion(logits, y)
        acc = self.train_acc(torch.argmax(logits, dim=1), y)
        return {"loss": loss, "acc": acc}



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--pairs", type=int, default=300, help="alternated rounds of blocks per size")
    p.add_argument("--steps", type=int, default=0, help="steps per block (0: about --block-seconds of steps)")
    p.add_argument("--block-seconds", type=float, default=0.03,
                   help="short blocks: the two of a pair see the same load on a shared CPU")
    p.add_argument("--warmup", type=int, default=100, help="steps of each variant before timing")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--pieces", action="store_true",
                   help="instead: the adapter's per-step pieces that the profile names, each alone (fastest of 5)")
    p.add_argument("--only", choices=("model", "lightning"), default=None,
                   help="instead: run --run-steps steps of one variant of the first size, for a profiler to record")
    p.add_argument("--run-steps", type=int, default=4000)
    p.add_argument("--spy-summary", nargs="+", type=Path, default=None,
                   help="instead: the share of the step in each piece, from `py-spy record --format raw` files")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def compose(size: str, variant: str, log_every: int) -> Any:
    """The job as `python -m runner` composes it: validation and checkpoints off, one epoch longer than any block."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runner.config import register_configs, register_resolvers

    features, hidden, depth, classes, batch = SIZES[size]
    model = {"lightning": ["model._target_=lightning_step.LitBench", "+model.lr=0.01", "+model.momentum=0.9"],
             "model": ["model._target_=lightning_step.ModelBench", "task=model"]}[variant]
    register_resolvers()
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(HERE.parent / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=[
            "accelerator=cpu", "strategy=single", "cluster=local", "trainer.devices=1", "logger=none",
            "callbacks=none", "optimizer=sgd", "optimizer.lr=0.01", "optimizer.momentum=0.9",
            "trainer.max_steps=100000000", "trainer.max_epochs=-1", f"trainer.log_every_n_steps={log_every}",
            "trainer.limit_val_batches=0", "trainer.progress_bar=false", f"data.num_features={features}",
            f"data.num_classes={classes}", f"data.batch_size={batch}", f"data.num_samples={batch * 64}",
            "data.val_samples=64", f"model.in_features={features}", f"model.hidden={hidden}",
            f"model.depth={depth}", f"model.num_classes={classes}", *model])


def build_loop(cfg: Any, run_dir: Path) -> Any:
    """The loop as runner.worker builds it for one CPU process (its `_train` up to the stage), hooks attached and
    on_fit_start called, in training mode."""
    from runner import build
    from runner.data import train_loader
    from runner.lightning import TrainerView
    from runner.lightning.attach import attach, setup_module
    from runner.loggers import NullLogger
    from runner.loop import Loop
    from runner.tasks import TaskModule

    strategy = build.build_strategy(cfg)
    torch.manual_seed(cfg.trainer.seed)
    view = TrainerView(cfg, strategy, run_dir)
    data = build.build_data(cfg, strategy, view)
    model = build.build_model(cfg)
    setup_module(model, view)
    precision = strategy.precision
    task = TaskModule(precision.convert_module(model), build.build_task(cfg), precision)
    strategy.module_to_device(task)
    wrapped = strategy.setup_module(task)
    train = train_loader(data, strategy.distributed_sampler_kwargs, cfg.trainer.seed)
    optimizer = build.build_optimizer(cfg, model)
    loop = Loop(strategy, task, wrapped, optimizer, build.build_scheduler(cfg, optimizer, 10**8), train, None,
                NullLogger(), cfg.trainer, run_dir, lambda: 0, {}, build.build_metrics(cfg, strategy),
                build.build_callbacks(cfg))
    attach(loop, view)
    loop.callbacks.call("on_fit_start", loop)
    loop.train_log.begin()
    loop.task.train()
    return loop


def stepper(loop: Any, batch: Any) -> Callable[[], None]:
    """One iteration of Loop._run's inner body on `batch`; the epoch never ends (its position wraps before)."""
    p, s = loop.progress, loop.schedule
    window = [batch] * s.accumulate

    def step() -> None:
        if p.batch + s.accumulate >= s.batches_per_epoch:
            p.batch = 0
        loop.heartbeat.step(p.step)
        p.batch += s.accumulate
        loop.train_step(window, loop)
        p.step += 1
        loop.callbacks.call("on_train_batch_end", loop, loop.train_step.outputs, p.step)
        loop._after_step()

    return step


def weights(loop: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in loop.strategy.unwrap(loop.wrapped).model.net.state_dict().items()}


def measure(size: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both variants of one size, alternated; per block the thread's CPU and wall seconds per step."""
    features, _, _, classes, batch_size = SIZES[size]
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(batch_size, features, generator=generator),
             torch.randint(0, classes, (batch_size,), generator=generator))
    loops = {v: build_loop(compose(size, v.split("+")[0], args.log_every), Path(tempfile.mkdtemp()))
             for v in ("model", "lightning")}
    steps = {v: stepper(loop, batch) for v, loop in loops.items()}
    same = check_same(loops, steps, args.log_every)
    for run in steps.values():
        for _ in range(args.warmup):
            run()
    per_block = args.steps or calibrate(steps["model"], args.block_seconds)
    cpu: dict[str, list[float]] = {v: [] for v in steps}
    wall: dict[str, list[float]] = {v: [] for v in steps}
    for pair in range(args.pairs):
        order = list(steps) if pair % 2 == 0 else list(steps)[::-1]
        for variant in order:
            run = steps[variant]
            c0, w0 = time.thread_time(), time.perf_counter()
            for _ in range(per_block):
                run()
            cpu[variant].append((time.thread_time() - c0) / per_block)
            wall[variant].append((time.perf_counter() - w0) / per_block)
    return {"size": size, "shape": dict(zip(("in_features", "hidden", "depth", "num_classes", "batch_size"),
                                             SIZES[size])),
            "steps_per_block": per_block, "pairs": args.pairs, "same_weights_and_logs_after_one_window": same,
            "cpu_s_per_step": cpu, "wall_s_per_step": wall}


def check_same(loops: dict[str, Any], steps: dict[str, Callable[[], None]], log_every: int) -> bool:
    """All start from the same weights and, after one log window on the batch, end with the same weights and log the
    same train/loss and train/acc: the variants did the same arithmetic (and the adapter weighs the losses right)."""
    start = [weights(loop) for loop in loops.values()]
    if any(not torch.equal(a[k], b[k]) for a, b in itertools.pairwise(start) for k in a):
        return False
    for run in steps.values():
        for _ in range(log_every + 1):  # the window's sums are collected a step after it closes
            run()
    after = [weights(loop) for loop in loops.values()]
    logged = [[loop.progress.metrics.get(k) for k in ("train/loss", "train/acc")] for loop in loops.values()]
    same_logs = all(None not in row and abs(row[0] - logged[0][0]) < 1e-6 and abs(row[1] - logged[0][1]) < 1e-6
                    for row in logged)
    return same_logs and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for a, b in itertools.pairwise(after)
                             for k in a)


def calibrate(run: Callable[[], None], seconds: float) -> int:
    """Steps of task=model's that take about `seconds` of this thread's CPU (the fastest of 5 tries)."""
    per_step = []
    for _ in range(5):
        start = time.thread_time()
        for _ in range(5):
            run()
        per_step.append((time.thread_time() - start) / 5)
    return max(3, round(seconds / min(per_step)))


def p10(values: list[float]) -> float:
    """The 10th percentile: a block's time without most of the load other processes put on the CPU."""
    return statistics.quantiles(values, n=10)[0] if len(values) > 1 else values[0]


def summary(times: dict[str, list[float]], variant: str) -> dict[str, Any]:
    """`variant` against task=model: per-step times, and the ratio per alternated pair of blocks."""
    ratios = [lit / plain for lit, plain in zip(times[variant], times["model"])]
    row = {v: {"min_us": min(times[v]) * 1e6, "median_us": statistics.median(times[v]) * 1e6}
           for v in ("model", variant)}
    row["ratio"] = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
                    "of_mins": min(times[variant]) / min(times["model"]),
                    "of_p10": p10(times[variant]) / p10(times["model"]),
                    "of_medians": statistics.median(times[variant]) / statistics.median(times["model"])}
    row["extra_us_median"] = row[variant]["median_us"] - row["model"]["median_us"]
    return row


def pieces() -> dict[str, float]:
    """Microseconds per call of what the LightningModule's step does beyond task=model's, each alone on a built
    loop (the small size): the fastest of 5 repeats, which a shared CPU disturbs least."""
    import timeit

    from runner.lightning.task import _row
    from runner.tasks.base import stats_row

    features, _, _, classes, batch_size = SIZES["small"]
    batch = (torch.randn(batch_size, features), torch.randint(0, classes, (batch_size,)))
    loop = build_loop(compose("small", "lightning", 50), Path(tempfile.mkdtemp()))
    run = stepper(loop, batch)
    for _ in range(60):
        run()
    task, value = loop.task, torch.tensor(0.5)
    recorder = loop.callbacks.by_name["lightning"].recorder

    def logged() -> None:
        with recorder.recording("train", "training_step"):
            task.model.log("train/loss", value, on_step=True, prog_bar=True)
            task.model.log("train/acc", task.model.train_acc, on_step=True, prog_bar=True)

    variants = {
        "the statistics row of a LightningModule logging 2 names (_row)": lambda: _row(
            [64, 64, 0, 0, 64, 64, 64], value, [value, value]),
        "the statistics row of task=model logging 1 name (stats_row, the baseline's)": lambda: stats_row(
            64, 64, value, value),
        "2 self.log calls (a tensor, a Metric) inside recording()": logged,
        "a logged value times its weight (one per name)": lambda: value * 64,
    }
    return {name: min(timeit.repeat(fn, number=5000, repeat=5)) / 5000 * 1e6 for name, fn in variants.items()}


def run_only(args: argparse.Namespace) -> None:
    """One variant's steps and nothing else: `py-spy record --format raw -o F -- python <this> --only V`."""
    size = args.sizes[0]
    features, _, _, classes, batch_size = SIZES[size]
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(batch_size, features, generator=generator),
             torch.randint(0, classes, (batch_size,), generator=generator))
    loop = build_loop(compose(size, args.only, args.log_every), Path(tempfile.mkdtemp()))
    step = stepper(loop, batch)
    for _ in range(args.run_steps):
        step()


SPY_PIECES = [  # (what, frames that belong to it: parts of py-spy's "qualified.name (file:line)" frames)
    ("TrainStep.__call__", ("TrainStep.__call__ (",)),
    ("  the task: LightningTask.forward or ModelTask.forward", ("LightningTask.forward (", "ModelTask.forward (")),
    ("    the user's step: LitBench.training_step or ModelBench.forward",
     ("LitBench.training_step (", "ModelBench.forward (")),
    ("    LightningTask.forward: next(model.parameters())", ("LightningTask.forward (runner/lightning/task.py:71)",)),
    ("    LogRecorder.log (self.log)", ("LogRecorder.log (",)),
    ("    LightningTask._train_value", ("LightningTask._train_value (",)),
    ("    the statistics row", ("stats_row (", "_row (")),
    ("  StepWeights.finish", ("StepWeights.finish (",)),
    ("  backward", ("Precision.backward (",)),
    ("  optimizer step", ("Precision.optimizer_step (",)),
    ("Callbacks.call (on_train_batch_end ...)", ("Callbacks.call (",)),
    ("Loop._after_step", ("Loop._after_step (",)),
]


def spy_summary(paths: list[Path]) -> None:
    for path in paths:
        stacks = []
        for line in path.read_text(errors="replace").splitlines():
            frames, _, count = line.rpartition(" ")
            stacks.append((frames.split(";"), int(count)))
        step = [(frames, n) for frames, n in stacks if any("stepper.<locals>.step (" in f for f in frames)]
        total = sum(n for _, n in step)
        print(f"\n{path.name}: {total} samples inside the step\n| piece | samples | share of the step |\n|---|---|---|")
        for name, prefixes in SPY_PIECES:
            inside = sum(n for frames, n in step if any(p in f for f in frames for p in prefixes))
            print(f"| {name} | {inside} | {100 * inside / max(total, 1):.1f} % |")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("runner").setLevel(logging.WARNING)  # the loop's start-up lines are not the measurement
    if args.spy_summary:
        return spy_summary(args.spy_summary)
    if args.only:
        return run_only(args)
    if args.pieces:
        print("| piece (small size) | us per call, fastest of 5 x 5000 |\n|---|---|")
        for name, micros in pieces().items():
            print(f"| {name} | {micros:.2f} |")
        return
    print(f"torch {torch.__version__}, lightning {pl.__version__}, Python {platform.python_version()}, "
          f"{args.threads} torch thread(s), {args.pairs} alternated block pairs, train log every {args.log_every} "
          "steps, NullLogger; thread CPU and wall per step", flush=True)
    results = []
    for size in args.sizes:
        result = measure(size, args)
        results.append(result)
        print(f"\n## {size} {result['shape']}: {result['steps_per_block']} steps per block, same weights and "
              f"train logs after one log window: {result['same_weights_and_logs_after_one_window']}", flush=True)
        print("| variant | clock | task=model us/step min / median | variant us/step min / median | ratio per pair "
              "min / median / max | ratio of mins, of 10th percentiles | extra us/step (medians) |\n"
              "|---|---|---|---|---|---|---|")
        for variant in (v for v in result["cpu_s_per_step"] if v != "model"):
            for clock in ("cpu", "wall"):
                row = result.setdefault("summary", {}).setdefault(variant, {})[clock] = summary(
                    result[f"{clock}_s_per_step"], variant)
                r = row["ratio"]
                print(f"| {variant} | {clock} | {row['model']['min_us']:.1f} / {row['model']['median_us']:.1f} | "
                      f"{row[variant]['min_us']:.1f} / {row[variant]['median_us']:.1f} | "
                      f"{r['min']:.4f} / **{r['median']:.4f}** / {r['max']:.4f} | {r['of_mins']:.4f}, {r['of_p10']:.4f} | "
                      f"{row['extra_us_median']:+.1f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
