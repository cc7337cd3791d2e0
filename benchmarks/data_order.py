"""Run 14: the data orders (a stream, a user's sampler) against the map-style shuffle, the loader workers' exit, and
the order's memory, each measured side by side in one run.

Suites (all alternated A B C, C B A, ... so that load from other work hits every variant alike; median (min-max)):

  * step: whole `python -m runner` runs of compare.py's job (MLP 64 -> 4 x 512 -> 10, SGD, batch 64 per process) on
    1 and 2 DDP processes, the training data given three ways: the built-in map-style set (`data=synthetic`, the
    runner's shuffle, `Shuffled`), the same tensors as a stream (tests/stream_data.py's `StreamData`: a sized
    IterableDataset read sample by sample, `StreamShare`), and the same set through a data module whose
    train_dataloader() has a WeightedRandomSampler (`WeightedData`: the runner's `Drawn` order). Per step: the
    median time between the run's `train/loss` TensorBoard events (compare.py's in-run method), and each process's
    CPU time per step between its first and last log step (the `CpuClock` callback below: on this shared machine
    the CPU clock resolves what the wall clock cannot); also the last window's `throughput/samples_per_s`.
  * loader: in one process, the same three training loaders (`runner.data.train_loader`, rank 0's share of 1 and of
    2 processes) alone, a plain `DataLoader(stream, batch_size)` over the same stream, the stream's batch in its two
    pieces (reading the samples, collating them), and each loader feeding the job's step; blocks alternated round
    by round, thread CPU and wall clocks: what a batch of each order costs, and its share of a step.
  * exit: a 20-step run with data.num_workers=2, the code of --before-tree (e08591d, before close_loaders) against
    HEAD, and HEAD without workers (the floor): seconds from the run's last log line to the process's exit, 1 process
    and 2 DDP processes.
  * memory: peak RSS and seconds to the first index of the first batch of TrainSampler over 10^8 samples: HEAD's
    `TrainSampler(Shuffled(n, 0), 64, 1, 0)` against the DistributedSampler-based `TrainSampler(sized, 64, 1, 0, 0)`
    of --before-tree, each imported from its own tree in its own process.

HEAD's code is a `git archive` of --head (uncommitted edits in the work tree cannot get in); --before is a tree of
the old commit (`git worktree add /tmp/runner-e08591d e08591d`). Each runs from its tree through PYTHONPATH, with
its tests/ folder (for stream_data.py) behind it.

    python benchmarks/data_order.py --before-tree /tmp/runner-e08591d --json benchmarks/results/run14-data-order.json
    python benchmarks/data_order.py --suite memory --before-tree /tmp/runner-e08591d --memory-pairs 3
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare  # its job, and how it reads a run's per-step time and start

PY = sys.executable
SUITES = ("step", "loader", "exit", "memory")
# The training data given three ways; the same tensors (SyntheticClassification's, seed 0) in each.
ORDERS = {
    "map": [],
    "stream": ["data._target_=stream_data.StreamData", "+data.sized=true", "+data.val_stream=false"],
    "weighted": ["data._target_=stream_data.WeightedData"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=SUITES, nargs="+", default=list(SUITES))
    p.add_argument("--head", default="HEAD", help="the commit measured as now (a git archive of it)")
    p.add_argument("--before-tree", type=Path, help="a tree of the commit before (exit, memory)")
    p.add_argument("--overlay", nargs="+", default=[], metavar="PATH",
                   help="files of the work tree laid over --head's archive (code not yet committed), each logged "
                        "with its git blob hash")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--pairs", type=int, nargs="+", default=[4, 2], help="step suite: rounds per process count")
    p.add_argument("--steps", type=int, default=400, help="step suite: steps per run (one epoch)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--loader-rounds", type=int, default=30)
    p.add_argument("--loader-batches", type=int, default=40, help="loader suite: batches (steps) per block")
    p.add_argument("--exit-pairs", type=int, nargs="+", default=[2, 2], help="exit suite: pairs per process count")
    p.add_argument("--exit-steps", type=int, default=20)
    p.add_argument("--memory-pairs", type=int, default=2)
    p.add_argument("--memory-size", type=int, default=10**8)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--json", type=Path, help="write every raw measurement here")
    p.add_argument("--child", choices=["loader", "memory-new", "memory-old"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- code trees and runs ------------------------------------------------------------------------------

ROOT = HERE.parent


def git(*argv: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def archive(rev: str, overlay: list[str]) -> tuple[Path, str, dict]:
    """A `git archive` of `rev` in a temporary folder with the `overlay` files of the work tree copied over it, its
    short hash (+ "overlay" when there is one), and each overlaid file's git blob hash."""
    commit = git("rev-parse", "--short", rev)
    folder = Path(tempfile.mkdtemp(prefix=f"run14-{commit}-"))
    tar = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(folder)], stdin=tar.stdout, check=True)
    tar.wait()
    blobs = {}
    for path in overlay:
        shutil.copyfile(ROOT / path, folder / path)
        blobs[path] = git("hash-object", str(folder / path))  # of the copy: the work tree may change meanwhile
    return folder, commit + ("+overlay" if overlay else ""), blobs


def tree_env(tree: Path, threads: int, **extra: str) -> dict:
    """The environment of a process running `tree`'s code: it first on PYTHONPATH, its tests/ behind it."""
    path = [str(tree), str(tree / "tests"), str(HERE / "rss_probe")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": str(threads), **extra}


def job(procs: int, steps: int, samples: int, log_every: int, *extra: str) -> list[str]:
    strategy = "ddp" if procs > 1 else "single"
    return [*compare.JOB, "accelerator=cpu", f"strategy={strategy}", f"trainer.devices={procs}",
            f"trainer.log_every_n_steps={log_every}", f"trainer.max_steps={steps}", f"data.num_samples={samples}",
            *extra]


class CpuClock:
    """A callback (`+callbacks.cpu_clock._target_=data_order.CpuClock`): each process's CPU and wall clocks at every
    log step, written at the end to $RUN14_CLOCKS.<rank>. CPU time per step is little disturbed by other work on the
    machine, where wall time per step is not."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, float, float]] = []

    def on_train_log(self, loop: Any, metrics: dict, step: int) -> None:
        self.marks.append((step, time.process_time(), time.perf_counter()))

    def on_fit_end(self, loop: Any, result: dict) -> None:
        path = os.environ.get("RUN14_CLOCKS")
        if path:
            Path(f"{path}.{os.environ.get('RANK', '0')}").write_text(json.dumps(self.marks))


def cpu_per_step(clocks: Path) -> float:
    """CPU seconds per step between the first and the last log step, the mean over the processes."""
    per_rank = []
    for file in sorted(clocks.parent.glob(clocks.name + ".*")):
        marks = json.loads(file.read_text())
        (a, cpu_a, _), (b, cpu_b, _) = marks[0], marks[-1]
        per_rank.append((cpu_b - cpu_a) / (b - a) if b > a else float("nan"))
    return statistics.mean(per_rank) if per_rank else float("nan")


def launch(tree: Path, overrides: list[str], args: argparse.Namespace, clock: bool = False) -> dict:
    """One whole run of `tree`'s runner: wall and CPU seconds, start-up, per-step time (in-run; with `clock`, also
    the CPU time per step of each process), the last window's samples/s, and seconds from its last log line to the
    process's exit."""
    scratch = Path(tempfile.mkdtemp(prefix="run14-"))
    out, probes = scratch / "run", scratch / "rss"
    probes.mkdir()
    command = [PY, "-m", "runner", *overrides, *(["+callbacks.cpu_clock._target_=data_order.CpuClock"] if clock
                                                 else []), f"hydra.run.dir={out}"]
    env = tree_env(tree, args.threads, RSS_PROBE_DIR=str(probes), RUN14_CLOCKS=str(scratch / "clocks"))
    env["PYTHONPATH"] += os.pathsep + str(HERE)  # this module, for CpuClock
    try:
        start, cpu_before = time.time(), compare.children_cpu()
        done = subprocess.run(command, env=env, cwd=scratch, capture_output=True, text=True, timeout=600, check=False)
        end = time.time()
        if done.returncode:
            lines = done.stderr.strip().splitlines() or ["?"]
            return {"failed": [line.strip() for line in lines if line.strip().startswith("- ")][:1] or lines[-1:]}
        intervals = compare.log_intervals(out, args.log_every)
        metrics = json.loads((out / "metrics.json").read_text())
        return {"wall": end - start, "cpu": compare.children_cpu() - cpu_before,
                "startup": compare.loop_start(out) - start,
                "step": statistics.median(s / (b - a) for a, b, s in intervals) if intervals else float("nan"),
                "intervals": intervals, "samples_per_s": metrics.get("throughput/samples_per_s"),
                "cpu_step": cpu_per_step(scratch / "clocks"),
                "exit_lag": end - last_log_time(out / "runner.log"), "rss_mb": compare.peak_rss(probes)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def last_log_time(log: Path) -> float:
    """Wall-clock time of the last timestamped line of a runner.log ("[2026-12-06 04:13:55,394][...")."""
    stamped = [line for line in log.read_text().splitlines() if line.startswith("[20")]
    when, millis = stamped[-1][1:24].split(",")
    return time.mktime(time.strptime(when, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def alternated(pairs: int, names: list[str]) -> list[list[str]]:
    """A B C, C B A, A B C, ...: each variant as often early as late in a pair."""
    return [names if pair % 2 == 0 else names[::-1] for pair in range(pairs)]


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    clean = [v for v in values if not math.isnan(v)]
    return compare.spread(clean, scale, digits) if clean else "n/a"


# -- suites -------------------------------------------------------------------------------------------

def suite_step(args: argparse.Namespace, head: Path) -> tuple[str, dict]:
    """Per step of whole runs: the stream and the user's sampler against the map-style shuffle."""
    rows, data = [], {}
    for procs, pairs in zip(args.procs, args.pairs):
        samples = max(4096, args.steps * 64 * procs)  # one epoch: no validation inside a log window
        runs: dict[str, list[dict]] = {name: [] for name in ORDERS}
        for pair, order in enumerate(alternated(pairs, list(ORDERS))):
            for name in order:
                run = launch(head, job(procs, args.steps, samples, args.log_every, *ORDERS[name]), args, clock=True)
                runs[name].append(run)
                print(f"  step {procs}p pair {pair + 1}/{pairs} {name:>8}: " + (
                    f"in-run {run['step'] * 1e3:6.3f} ms/step, CPU {run['cpu_step'] * 1e3:6.3f} ms/step  "
                    f"{run['samples_per_s']:7.0f} samples/s  "
                    f"wall {run['wall']:5.2f}s  cpu {run['cpu']:5.2f}s" if "failed" not in run
                    else f"FAILED {run['failed'][0]}"), flush=True)
        data[f"{procs}"] = runs
        rows += step_rows(procs, pairs, runs)
    header = ("| processes | order | pairs | wall ms/step (in-run) | / map-style (wall) | CPU ms/step per process "
              "(in-run) | / map-style (CPU) | samples/s, last window |")
    return "\n".join([header, "|" + "---|" * 8, *rows]), data


def step_rows(procs: int, pairs: int, runs: dict[str, list[dict]]) -> list[str]:
    rows, base = [], runs["map"]
    for name, mine in runs.items():
        if any("failed" in r for r in mine + base):
            failed = next(r["failed"] for r in mine + base if "failed" in r)
            rows.append(f"| {procs} | {name} | {pairs} | failed: {failed[0][:160]} | | | | |")
            continue
        cells = []
        for key in ("step", "cpu_step"):
            values = [r[key] for r in mine]
            cells += [spread(values, 1e3), f"**{spread(ratios(values, [b[key] for b in base]))}**"]
        rows.append(f"| {procs} | {name} | {pairs} | " + " | ".join(cells)
                    + f" | {spread([r['samples_per_s'] for r in mine], digits=0)} |")
    return rows


def suite_loader(args: argparse.Namespace, head: Path) -> tuple[str, dict]:
    """Each training loader in one process (HEAD's code): alone, and feeding the job's step, blocks alternated."""
    child = subprocess.run([PY, __file__, "--child", "loader", "--loader-rounds", str(args.loader_rounds),
                            "--loader-batches", str(args.loader_batches), "--procs", *map(str, args.procs)],
                           env=tree_env(head, args.threads), capture_output=True, text=True, timeout=600, check=False)
    if child.returncode:
        raise RuntimeError(f"loader child failed:\n{child.stderr[-3000:]}")
    data = json.loads(child.stdout.strip().splitlines()[-1])
    rows = []
    for world, variants in data.items():
        for name, times in variants.items():
            if isinstance(times, str):
                rows.append(f"| {world} | {name} | refused: {times[:160]} | | | |")
                continue
            base = variants["step + map" if name.startswith("step") else "map"]
            cells = []
            for clock in ("cpu", "wall"):
                mine, first = times[clock], base[clock]
                cells.append(f"{spread(mine, 1e6, 1)}")
                cells.append(f"**{spread(ratios(mine, first))}**" if name.startswith("step")
                             else spread([a - b for a, b in zip(mine, first)], 1e6, 1))
            rows.append(f"| {world} | {name} | " + " | ".join(cells) + " |")
    header = ("| num_replicas (rank 0's share) | variant | thread CPU µs per batch | CPU: over map µs, or step ratio "
              "| wall µs per batch | wall: over map µs, or step ratio |")
    return "\n".join([header, "|---|---|---|---|---|---|", *rows]), data


def ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def suite_exit(args: argparse.Namespace, head: Path, commit: str) -> tuple[str, dict]:
    """Seconds from the last log line to exit of a short run with 2 loader workers: before the fix against HEAD, and
    HEAD without workers (what exiting costs anyway)."""
    before = git("rev-parse", "--short", "HEAD", cwd=args.before_tree)
    cases = {f"{before}, 2 workers": (args.before_tree, 2), f"{commit}, 2 workers": (head, 2),
             f"{commit}, 0 workers": (head, 0)}
    rows, data = [], {}
    for procs, pairs in zip(args.procs, args.exit_pairs):
        runs: dict[str, list[dict]] = {name: [] for name in cases}
        for pair, order in enumerate(alternated(pairs, list(cases))):
            for name in order:
                tree, workers = cases[name]
                run = launch(tree, job(procs, args.exit_steps, 4096, args.log_every, f"data.num_workers={workers}"),
                             args)
                runs[name].append(run)
                print(f"  exit {procs}p pair {pair + 1}/{pairs} {name:>26}: " + (
                    f"last log line -> exit {run['exit_lag']:6.2f}s  wall {run['wall']:6.2f}s" if "failed" not in run
                    else f"FAILED {run['failed'][0]}"), flush=True)
        data[f"{procs}"] = runs
        for name, mine in runs.items():
            rows.append(f"| {procs} | {name} | {pairs} | **{spread([r['exit_lag'] for r in mine], digits=2)}** "
                        f"| {spread([r['wall'] for r in mine], digits=2)} |")
    header = "| processes | code | runs | last log line -> exit, s | whole run wall, s |"
    return "\n".join([header, "|---|---|---|---|---|", *rows]), data


def suite_memory(args: argparse.Namespace, head: Path, commit: str) -> tuple[str, dict]:
    """The first batch of TrainSampler over --memory-size samples, HEAD's and --before's, each in its own process."""
    before = git("rev-parse", "--short", "HEAD", cwd=args.before_tree)
    variants = {commit: ("memory-new", head), before: ("memory-old", args.before_tree)}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for pair, order in enumerate(alternated(args.memory_pairs, list(variants))):
        for name in order:
            child, tree = variants[name]
            done = subprocess.run([PY, __file__, "--child", child, "--memory-size", str(args.memory_size)],
                                  env=tree_env(tree, args.threads), capture_output=True, text=True, timeout=600,
                                  check=False)
            if done.returncode:
                raise RuntimeError(f"memory child {name} failed:\n{done.stderr[-3000:]}")
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(run)
            print(f"  memory pair {pair + 1}/{args.memory_pairs} {name:>15}: peak {run['peak_mb']:7.0f} MB "
                  f"(at start {run['start_mb']:.0f})  first index {run['first_s']:6.3f}s  first batch "
                  f"{run['batch_s']:6.3f}s", flush=True)
    same = len({tuple(r["first"]) for rs in runs.values() for r in rs}) == 1
    rows = [f"| {name} | {spread([r['peak_mb'] for r in rs], digits=0)} "
            f"| {spread([r['peak_mb'] - r['start_mb'] for r in rs], digits=0)} "
            f"| {spread([r['first_s'] for r in rs], digits=3)} | {spread([r['batch_s'] for r in rs], digits=3)} |"
            for name, rs in runs.items()]
    header = ("| code | peak RSS MB | over the RSS after imports, MB | s to the first index | s to the first batch "
              "(64) |")
    note = f"\nthe first batch's indices are {'the same' if same else 'DIFFERENT'} in every run"
    return "\n".join([header, "|---|---|---|---|---|", *rows]) + note, {"runs": runs, "same_first_batch": same}


# -- children (run with a tree's code first on PYTHONPATH) ----------------------------------------------

def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Sized:
    """A data set of which DistributedSampler reads only the length."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def child_memory(args: argparse.Namespace, new: bool) -> None:
    from runner.data import TrainSampler

    if new:
        from runner.data.order import Shuffled
    start_mb = rss_mb()
    started = time.perf_counter()
    sampler = (TrainSampler(Shuffled(args.memory_size, 0), 64, 1, 0) if new
               else TrainSampler(Sized(args.memory_size), 64, 1, 0, 0))
    indices = iter(sampler)
    first = [next(indices)]
    first_s = time.perf_counter() - started
    first += [next(indices) for _ in range(63)]
    batch_s = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux
    print(json.dumps({"peak_mb": peak, "start_mb": start_mb, "first_s": first_s, "batch_s": batch_s,
                      "first": first}))


def child_loader(args: argparse.Namespace) -> None:
    """Per batch, rank 0's share of each process count: each training loader alone, its pieces, and each feeding the
    job's step (the MLP, SGD with momentum; one process, so with 2 the step lacks DDP's all-reduce and the ratio is an
    upper bound). Blocks of --loader-batches alternate round by round; thread CPU and wall clocks."""
    import torch

    torch.set_num_threads(args.threads)
    settings = {"num_samples": max(args.procs) * 64 * args.loader_batches * (args.loader_rounds + 2),
                "num_features": 64, "num_classes": 10, "batch_size": 64}
    step = job_step()
    results = {f"{world}": time_loaders(loader_variants(world, settings, step), args.loader_rounds,
                                        args.loader_batches) for world in args.procs}
    print(json.dumps(results))


def loader_variants(world: int, settings: dict, step: Any) -> dict[str, Any]:
    """name -> a function making the iterable a variant reads, for rank 0 of `world` processes."""
    from stream_data import StreamData, WeightedData
    from torch.utils.data import DataLoader

    from runner.data import SyntheticClassification, ready, train_loader

    kwargs = {"num_replicas": world, "rank": 0}
    stream = StreamData(sized=True, val_stream=False, **settings).train_dataset
    loaders = {
        "map": lambda: train_loader(SyntheticClassification(**settings), kwargs, 0),
        "stream": lambda: train_loader(StreamData(sized=True, val_stream=False, **settings), kwargs, 0),
        "weighted": lambda: train_loader(ready(WeightedData(**settings), "fit"), kwargs, 0),
    }
    makers = dict(loaders)
    if world == 1:  # what plain torch pays to read the same stream: no share, the same default collate
        makers["torch DataLoader(stream)"] = lambda: DataLoader(stream, batch_size=64)
    # The stream's batch in its two pieces: reading a global batch's samples (every process reads all of them),
    # and collating this process's 64.
    makers[f"piece: read {64 * world} samples"] = lambda: reads(stream, 64 * world)
    makers["piece: collate 64 samples"] = lambda: collates(list(itertools.islice(iter(stream), 64)))
    for name, make in loaders.items():
        makers[f"step + {name}"] = functools.partial(stepped, step, make)
    return makers


def stepped(step: Any, make: Any) -> Iterator[None]:
    return map(step, make())


def job_step() -> Any:
    """compare.py's job's step by hand (handwritten.py's model): forward, cross-entropy, backward, SGD."""
    import handwritten
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = handwritten.make_model(handwritten.parse_args(["--steps", "1", "--out", "unused"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(batch: Any) -> None:
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def reads(stream: Any, count: int) -> Iterator[list]:
    samples = iter(stream)
    while True:
        yield list(itertools.islice(samples, count))


def collates(samples: list) -> Iterator[Any]:
    from runner.data import collate

    while True:
        yield collate(samples)


def time_loaders(makers: dict, rounds: int, batches: int) -> dict[str, Any]:
    """-> variant -> {"cpu": [s per batch, per round], "wall": [...]}, or why the variant could not be made."""
    iterators, times = {}, {}
    for name, make in makers.items():
        try:
            iterators[name] = iter(make())
            for _ in range(3):  # the epoch's order drawn, the first batches read (and stepped): outside the timing
                next(iterators[name])
            times[name] = {"cpu": [], "wall": []}
        except Exception as error:  # noqa: BLE001 - a refused variant is reported, the others measured
            times[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
    for order in alternated(rounds, list(iterators)):
        for name in order:
            cpu, wall = time.thread_time(), time.perf_counter()
            for _ in range(batches):
                next(iterators[name])
            times[name]["cpu"].append((time.thread_time() - cpu) / batches)
            times[name]["wall"].append((time.perf_counter() - wall) / batches)
    return times


# -- main -----------------------------------------------------------------------------------------------

def main() -> None:
    args = parse_args()
    if args.child:
        child_loader(args) if args.child == "loader" else child_memory(args, new=args.child == "memory-new")
        return
    if {"exit", "memory"} & set(args.suite) and not (args.before_tree and (args.before_tree / "runner").is_dir()):
        sys.exit("--suite exit/memory need --before-tree DIR holding runner/ (git worktree add DIR e08591d)")
    head, commit, blobs = archive(args.head, args.overlay)
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()}; OMP_NUM_THREADS={args.threads}; "
          f"head {args.head} = {commit}; overlay {blobs or 'none'}; before {args.before_tree}", flush=True)
    suites = {"step": lambda: suite_step(args, head), "loader": lambda: suite_loader(args, head),
              "exit": lambda: suite_exit(args, head, commit), "memory": lambda: suite_memory(args, head, commit)}
    results = {}
    try:
        for name in args.suite:
            started = time.time()
            table, results[name] = suites[name]()
            print(f"\n## {name} ({time.time() - started:.0f} s, load {os.getloadavg()})\n\n{table}\n", flush=True)
    finally:
        shutil.rmtree(head, ignore_errors=True)
        if args.json:
            meta = {k: str(v) for k, v in vars(args).items()}
            args.json.write_text(json.dumps({"head": commit, "overlay": blobs, "args": meta, "results": results},
                                            indent=1) + "\n")


if __name__ == "__main__":
    main()
