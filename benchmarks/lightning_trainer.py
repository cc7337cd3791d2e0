"""The runner against Lightning's own Trainer on the same LightningModule and the same LightningDataModule, as whole
commands alternated round by round: `python -m runner model._target_=... data._target_=...` (1 process, or
`strategy=ddp trainer.devices=2`) against a script that calls `Trainer(...).fit(module, datamodule)` (1 process, or
`strategy="ddp", devices=2` on the CPU, Lightning's own launcher starting the second process).

Per step is timed inside each run, not from the command's wall time (a 1 ms step is lost in a start-up's noise): a
callback of each (the runner's own hook, a Lightning Callback) stamps the end of every training batch with the wall
clock and the training thread's CPU clock; a step is the time between two stamps (data, step, logging: everything the
loop does between batches), the first `--warmup` left out; a run's figure is the median of its steps. Start-up is the
command's launch to the end of its first training step; whole is the command's wall time (validation, checkpoint and
exit included). Rounds alternate A B, B A; ratios runner / Lightning are taken per round, then the median.

The module (`Lit`) is lightning_step.py's pair's LightningModule shape (an MLP, cross-entropy, a torchmetrics Accuracy
called on the batch, `self.log` of the loss tensor and of the Metric every step, SGD from configure_optimizers) with
a validation step; the data module holds a synthetic classification set in memory (inputs labelled by a random
teacher) and gives `DataLoader(TensorDataset, shuffle=True)`. Both sides: TensorBoard logging every
`--log-every` steps, one epoch of `--steps` steps, validation at its end, a checkpoint at the end, no progress bar
(the runner shows none without a terminal), OMP_NUM_THREADS=`--threads` for every process.

    python benchmarks/lightning_trainer.py --json benchmarks/results/run20-lightning-trainer.json
    python benchmarks/lightning_trainer.py --procs 1 --rounds 2 --steps 500        # a quick look
    python benchmarks/lightning_trainer.py --snapshot /tmp/snap-before             # also an earlier runner's code
    python benchmarks/lightning_trainer.py --profile runner --steps 3000           # one run under cProfile (rank 0)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification.accuracy import Accuracy

from compare import wait_for_quiet  # this folder is on sys.path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIZES = {  # name -> (in_features, hidden, depth, num_classes, batch_size)
    "small": (32, 64, 2, 10, 64),  # under a millisecond per step: the trainers' own cost shows most
    "mlp512": (64, 512, 4, 10, 64),  # compare.py's job: a few ms per step on this CPU
}


class Lit(pl.LightningModule):
    """A lightning-hydra-template style module: a net, cross-entropy, Accuracy metrics, self.log, SGD."""

    def __init__(self, in_features: int, hidden: int, depth: int, num_classes: int, lr: float = 0.01,
                 momentum: float = 0.9) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.net = nn.Sequential(*layers, nn.Linear(width, num_classes))
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = Accuracy(task="multiclass", num_classes=num_classes)
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

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.forward(x)
        self.val_acc(torch.argmax(logits, dim=1), y)
        self.log("val/loss", self.criterion(logits, y), on_epoch=True, sync_dist=True)
        self.log("val/acc", self.val_acc, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Data(pl.LightningDataModule):
    """In-memory inputs labelled by a fixed random teacher; the keys are data=synthetic's, so the runner's
    `data._target_=lightning_trainer.Data` takes its other settings as they are."""

    def __init__(self, num_samples: int = 4096, val_samples: int = 1000, test_samples: int = 0,
                 num_features: int = 32, num_classes: int = 4, batch_size: int = 64, seed: int = 0,
                 num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__()
        self.sizes, self.features, self.classes = (num_samples, val_samples), num_features, num_classes
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        teacher = torch.randn(self.features, self.classes, generator=generator)
        x = torch.randn(sum(self.sizes), self.features, generator=generator)
        y = (x @ teacher).argmax(1)
        self.train_set = TensorDataset(x[:self.sizes[0]], y[:self.sizes[0]])
        self.val_set = TensorDataset(x[self.sizes[0]:], y[self.sizes[0]:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)


class _Stamps:
    """The end of each training batch: (epoch seconds, perf_counter, this thread's and this process's CPU seconds);
    written per rank."""

    def __init__(self, out: str) -> None:
        self.out, self.stamps = Path(out), []

    def stamp(self) -> None:
        self.stamps.append((time.time(), time.perf_counter(), time.thread_time(), time.process_time()))

    def write(self, rank: int, metrics: dict) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))
                   and (not isinstance(v, torch.Tensor) or v.numel() == 1)}
        (self.out / f"stamps-rank{rank}.json").write_text(json.dumps({"stamps": self.stamps, "metrics": numbers}))


class RunnerStamps(_Stamps):
    """The runner's callback (`+callbacks.stamps._target_=lightning_trainer.RunnerStamps +callbacks.stamps.out=D`)."""

    def on_train_batch_end(self, loop: Any, outputs: Any, step: int) -> None:
        self.stamp()

    def on_fit_end(self, loop: Any, result: dict) -> None:
        self.write(loop.strategy.global_rank, result)


class LightningStamps(_Stamps, pl.Callback):
    def __init__(self, out: str) -> None:
        _Stamps.__init__(self, out)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.stamp()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.write(trainer.global_rank, trainer.callback_metrics)


def data_settings(args: argparse.Namespace, procs: int) -> dict:
    features, _, _, classes, batch = SIZES[args.size]
    return {"num_samples": args.steps * batch * procs, "val_samples": args.val_samples, "num_features": features,
            "num_classes": classes, "batch_size": batch}


def module_settings(args: argparse.Namespace) -> dict:
    features, hidden, depth, classes, _ = SIZES[args.size]
    return {"in_features": features, "hidden": hidden, "depth": depth, "num_classes": classes}


def runner_command(args: argparse.Namespace, procs: int, out: Path) -> list[str]:
    strategy = ["strategy=ddp", f"trainer.devices={procs}"] if procs > 1 else ["strategy=single", "trainer.devices=1"]
    data = [f"data.{k}={v}" for k, v in data_settings(args, procs).items()]
    model = [f"model.{k}={v}" for k, v in module_settings(args).items()]
    return [sys.executable, "-m", "runner", "accelerator=cpu", *strategy, "model._target_=lightning_trainer.Lit",
            *model, "data._target_=lightning_trainer.Data", *data, f"trainer.max_steps={args.steps}",
            "trainer.max_epochs=-1", f"trainer.log_every_n_steps={args.log_every}", "trainer.progress_bar=false",
            "objective=val/loss", "+callbacks.stamps._target_=lightning_trainer.RunnerStamps",
            f"+callbacks.stamps.out={out}", f"hydra.run.dir={out}"]


def lightning_command(args: argparse.Namespace, procs: int, out: Path) -> list[str]:
    return [sys.executable, str(Path(__file__)), "--lightning-run", "--procs", str(procs), "--size", args.size,
            "--steps", str(args.steps), "--val-samples", str(args.val_samples), "--log-every", str(args.log_every),
            "--out", str(out)]


def lightning_run(args: argparse.Namespace) -> None:
    """One Lightning fit (and, under strategy="ddp", each process Lightning's launcher starts runs this again)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    procs, out = args.procs[0], Path(args.out)
    trainer = pl.Trainer(accelerator="cpu", devices=procs, strategy="ddp" if procs > 1 else "auto",
                         max_steps=args.steps, log_every_n_steps=args.log_every, enable_progress_bar=False,
                         default_root_dir=str(out), logger=TensorBoardLogger(str(out), name="", version=""),
                         callbacks=[LightningStamps(str(out))])
    trainer.fit(Lit(**module_settings(args)), datamodule=Data(**data_settings(args, procs)))


def environment(args: argparse.Namespace, code: Path = REPO) -> dict:
    """The children's environment; `code`: the tree whose runner runs (a snapshot's, or this one's)."""
    path = os.pathsep.join(filter(None, [str(code), str(HERE), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}


def one_run(name: str, command: list[str], out: Path, env: dict) -> dict:
    """Launch, wait, read rank 0's stamps: per step (wall and CPU medians), start-up, whole, the final metrics."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launched, start = time.time(), time.perf_counter()
    done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=1800, check=False)
    whole = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{name} failed ({' '.join(command)}):\n{done.stderr[-4000:]}")
    record = json.loads((out / "stamps-rank0.json").read_text())
    stamps = record["stamps"]
    ranks = sorted(out.glob("stamps-rank*.json"))
    startup_cpu = [json.loads(path.read_text())["stamps"][0][3] for path in ranks]  # each rank's, to its first step
    # The CPU of the processes waited for: all of the runner's; not the process Lightning's launcher starts.
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"whole_s": whole, "whole_cpu_s": cpu, "startup_s": stamps[0][0] - launched, "steps": len(stamps),
            "load_1min": load, "startup_cpu_s_per_rank": startup_cpu,
            "step_wall_us": _median_gap(stamps, 1), "step_cpu_us": _median_gap(stamps, 2),
            "metrics": {k: v for k, v in record["metrics"].items() if k.startswith(("val/", "train/"))}}


WARMUP = 20  # the first steps warm caches and allocators on both sides


def _median_gap(stamps: list, clock: int) -> float:
    gaps = [b[clock] - a[clock] for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1:])]
    return statistics.median(gaps) * 1e6


def variants(args: argparse.Namespace, procs: int) -> dict[str, Path]:
    """Each runner to time, by name -> its code: this tree's (`runner`), each --snapshot's (`runner@<folder>`), and
    with --fork and several processes this tree's with strategy.start_method=fork (`runner+fork`)."""
    fork = {"runner+fork": REPO} if args.fork and procs > 1 else {}
    return {"runner": REPO, **fork, **{f"runner@{Path(s).name}": Path(s).resolve() for s in args.snapshot}}


def measure(args: argparse.Namespace, procs: int) -> list[dict]:
    """`args.rounds` rounds of the commands, the order reversed every other round."""
    codes, rounds = variants(args, procs), []
    for index in range(args.rounds):
        wait_for_quiet(args.wait_load, args.wait_max)
        names = [*codes, "lightning"]
        found = {}
        for name in names if index % 2 == 0 else names[::-1]:
            out = Path(tempfile.mkdtemp(prefix=f"lt-{name.replace('@', '-')}-"))
            command = (lightning_command if name == "lightning" else runner_command)(args, procs, out)
            command += ["strategy.start_method=fork"] if name.endswith("+fork") else []
            found[name] = one_run(name, command, out, environment(args, codes.get(name, REPO)))
        rounds.append(found)
        lit = found["lightning"]
        print(f"  {procs} process(es), round {index + 1}, load {lit['load_1min']:.1f}: Lightning {lit['step_wall_us']:.0f} "
              f"us/step, start-up {lit['startup_s']:.2f} s, whole {lit['whole_s']:.2f} s; " + "; ".join(
                  f"{name} {found[name]['step_wall_us']:.0f} us/step, {found[name]['startup_s']:.2f} s, "
                  f"{found[name]['whole_s']:.2f} s" for name in codes), flush=True)
    return rounds


def _cell(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


MEASURES = (("step_wall_us", "per step, wall µs", 0), ("step_cpu_us", "per step, CPU µs", 0),
            ("startup_s", "start-up (launch to first step end), s", 2), ("whole_s", "whole command, s", 2))


def table(results: dict[int, list[dict]]) -> str:
    """Medians (min-max) over the rounds, and each runner's ratio to Lightning per round."""
    lines = ["| processes | measure | runner | Lightning Trainer | **runner / Lightning, per round** |",
             "|---|---|---|---|---|"]
    for procs, rounds in results.items():
        for name in (n for n in rounds[0] if n != "lightning"):
            for key, label, digits in MEASURES:
                ours, theirs = [r[name][key] for r in rounds], [r["lightning"][key] for r in rounds]
                ratios = [a / b for a, b in zip(ours, theirs)]
                lines.append(f"| {procs} | {label} ({name}) | {_cell(ours, digits)} | {_cell(theirs, digits)} | "
                             f"**{statistics.median(ratios):.3f}** ({min(ratios):.3f}-{max(ratios):.3f}) |")
    return "\n".join(lines)


def profile(args: argparse.Namespace) -> None:
    """One run of `args.profile` with rank 0 (the only process with 1) under cProfile, its stats printed."""
    out = Path(tempfile.mkdtemp(prefix=f"lt-profile-{args.profile}-"))
    procs = args.procs[0]
    command = (runner_command if args.profile == "runner" else lightning_command)(args, procs, out)
    stats = out / "profile.out"
    command = [command[0], "-m", "cProfile", "-o", str(stats), *command[1:]]
    done = subprocess.run(command, cwd=out, env=environment(args), capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    import pstats

    pstats.Stats(str(stats)).sort_stats(args.sort).print_stats(args.top)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=6, help="alternated rounds per process count")
    p.add_argument("--size", choices=list(SIZES), default="small")
    p.add_argument("--steps", type=int, default=2000, help="training steps per process (one epoch)")
    p.add_argument("--val-samples", type=int, default=1024)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--snapshot", action="append", default=[],
                   help="also time the runner of this folder (runner/ and conf/, e.g. a git archive), repeatable")
    p.add_argument("--fork", action="store_true", help="also the runner with strategy.start_method=fork")
    p.add_argument("--wait-load", type=float, default=0.0,
                   help="before each round, wait for the 1-minute load to fall below this (0: do not wait)")
    p.add_argument("--wait-max", type=float, default=300.0, help="seconds to wait for it at most")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--profile", choices=("runner", "lightning"), default=None)
    p.add_argument("--sort", default="tottime")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--lightning-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.lightning_run:
        return lightning_run(args)
    if args.profile:
        return profile(args)
    print(f"torch {torch.__version__}, lightning {pl.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, size {args.size} {SIZES[args.size]}, {args.steps} steps per process, log every "
          f"{args.log_every}, OMP_NUM_THREADS={args.threads}, {args.rounds} alternated rounds", flush=True)
    results = {procs: measure(args, procs) for procs in args.procs}
    print("\n" + table(results))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": {str(k): v for k, v in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
