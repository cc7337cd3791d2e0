"""Side-by-side timings of `python -m runner` against the hand-written loop in benchmarks/handwritten.py.

Every measurement alternates its variants (A B A B ...) so that drift on a shared machine hits them
alike, and reports the median with the spread (min-max) over the pairs.

Per-step time, three ways, none touching the runner:
  * difference: (wall(N2) - wall(N1)) / (N2 - N1) over two whole runs; start-up and teardown cancel out.
  * in-run: the median time between `train/loss` TensorBoard events (at multiples of --log-every) of the
    N2 run, divided by the steps between them (robust to a burst of load from other work on the machine).
  * CPU: the difference method on the CPU seconds of all the run's processes (least disturbed by other load).
Start-up is launch -> the loop's first step (the runner's "global batch ..." log line, the hand-written
script's `loop_start` file). Peak memory is each process's max RSS (benchmarks/rss_probe).

    python benchmarks/compare.py                       # all suites on CPU, 1 and 2 processes
    python benchmarks/compare.py --suite step --procs 2 --pairs 3
    python benchmarks/compare.py --accelerator cuda    # the same work on GPUs
    python benchmarks/compare.py --suite versions --procs 2 --snapshots /tmp/snap-a /tmp/snap-b  # code A/B
    python benchmarks/compare.py --suite lm --procs 1 2 --pairs 3 --steps 10 100 --log-every 25  # experiment=charlm
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
PY = sys.executable
# The benchmark's job, as runner overrides (the hand-written script's defaults are the same values).
JOB = ["model.hidden=512", "model.depth=4", "data.num_features=64", "data.num_classes=10", "data.batch_size=64",
       "optimizer=sgd", "optimizer.lr=0.01", "optimizer.momentum=0.9"]
# The `lm` suite's job: the charlm example as it is configured (conf/experiment/charlm.yaml), against
# benchmarks/handwritten_lm.py, whose defaults are the same values.
LM_JOB = ["experiment=charlm"]
LM_BATCH, LM_BLOCK, LM_MAX_BYTES, LM_VAL_FRACTION = 32, 128, 2_000_000, 0.05
SUITES = ("cli", "step", "logging", "ckpt", "compile", "versions", "lm", "fsdp", "fsdp_memory")

Command = Callable[[int, Path], list[str]]  # (steps, run folder) -> argv
SuiteResult = tuple[str, dict]  # (markdown table, raw numbers)


@dataclass
class Run:
    wall: float  # seconds, launch -> exit
    cpu: float  # CPU seconds (user + system) of the launched process and all its descendants
    startup: float  # seconds, launch -> first step
    step_inrun: float  # seconds per step, median over the log intervals
    intervals: list = field(default_factory=list)  # (first step, last step, seconds) between train/loss events
    rss_mb: dict = field(default_factory=dict)  # role -> max RSS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # `lm` and `fsdp_memory` only when asked for: their steps take 0.1-0.8 s on 2 CPU cores, so they need their own --steps.
    p.add_argument("--suite", choices=SUITES, nargs="+", default=[s for s in SUITES if s not in ("lm", "fsdp_memory")])
    p.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="process counts for the step suite")
    p.add_argument("--pairs", type=int, default=5, help="A/B pairs per comparison")
    p.add_argument("--steps", type=int, nargs=2, default=[100, 600], metavar=("N1", "N2"))
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every process of every run")
    p.add_argument("--cli-repeats", type=int, default=10)
    p.add_argument("--json", type=Path, help="write every raw measurement here")
    p.add_argument("--wait-load", type=float, default=0.0,
                   help="before each pair, wait for the 1-minute load to fall below this (0: do not wait)")
    p.add_argument("--wait-max", type=float, default=300.0, help="seconds to wait for it at most")
    p.add_argument("--snapshots", type=Path, nargs="+", default=[],
                   help="for --suite versions, or step (each against the hand-written loop): folders holding runner/ "
                        "and conf/ (git archive <commit> | tar -x -C DIR)")
    return p.parse_args(argv)


# -- commands -----------------------------------------------------------------------------------------

def num_samples(steps: int, procs: int) -> int:
    """One epoch covers the whole run, so no log interval holds an epoch-end validation."""
    return max(4096, steps * 64 * procs)


def runner_cmd(args: argparse.Namespace, procs: int, *extra: str, log_every: int | None = None,
               snapshot: Path | None = None, strategy: str | None = None, job: list[str] | None = None) -> Command:
    """The runner's command line; from `snapshot`'s code (first on PYTHONPATH) when given."""
    strategy = strategy or ("ddp" if procs > 1 else "single")
    path = [str(snapshot.resolve()), str(HERE / "rss_probe"), os.environ.get("PYTHONPATH")] if snapshot else []
    base = [*(["env", "PYTHONPATH=" + os.pathsep.join(filter(None, path))] if snapshot else []), PY, "-m", "runner", *(job or JOB), f"accelerator={args.accelerator}", f"strategy={strategy}",
            f"trainer.devices={procs}", f"trainer.log_every_n_steps={log_every or args.log_every}", *extra]
    return lambda steps, out: [*base, f"trainer.max_steps={steps}",
                               f"data.num_samples={num_samples(max(args.steps), procs)}", f"hydra.run.dir={out}"]


def lm_max_bytes(steps: int, procs: int) -> int:
    """The experiment's 2 MB of text, or more when the longest run would otherwise start a second epoch."""
    needed = steps * LM_BATCH * procs * LM_BLOCK + 1  # the training bytes of `steps` global batches
    return max(LM_MAX_BYTES, math.ceil(needed / (1 - LM_VAL_FRACTION)) + LM_BLOCK)


def lm_runner_cmd(args: argparse.Namespace, procs: int) -> Command:
    """`python -m runner experiment=charlm ...`: validation only at the end (as the hand-written loop does it)."""
    strategy = "ddp" if procs > 1 else "single"
    base = [PY, "-m", "runner", *LM_JOB, f"accelerator={args.accelerator}", f"strategy={strategy}",
            f"trainer.devices={procs}", f"trainer.log_every_n_steps={args.log_every}",
            f"trainer.val_check_interval={max(args.steps) + 1}",
            f"data.max_bytes={lm_max_bytes(max(args.steps), procs)}"]
    return lambda steps, out: [*base, f"trainer.max_steps={steps}", f"hydra.run.dir={out}"]


def lm_handwritten_cmd(args: argparse.Namespace, procs: int) -> Command:
    launch = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"] if procs > 1 else [PY]
    base = [*launch, str(HERE / "handwritten_lm.py"), "--accelerator", args.accelerator, "--log-every",
            str(args.log_every), "--max-bytes", str(lm_max_bytes(max(args.steps), procs))]
    return lambda steps, out: [*base, "--steps", str(steps), "--out", str(out)]


def handwritten_cmd(args: argparse.Namespace, procs: int, log_every: int | None = None, fsdp: bool = False) -> Command:
    launch = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"] if procs > 1 else [PY]
    base = [*launch, str(HERE / "handwritten.py"), "--accelerator", args.accelerator, "--log-every",
            str(log_every or args.log_every), "--num-samples", str(num_samples(max(args.steps), procs)),
            *(["--fsdp"] if fsdp else [])]
    return lambda steps, out: [*base, "--steps", str(steps), "--out", str(out)]


# -- one run ------------------------------------------------------------------------------------------

def run_once(command: Command, steps: int, args: argparse.Namespace) -> Run:
    scratch = Path(tempfile.mkdtemp(prefix="bench-"))
    out, probes = scratch / "run", scratch / "rss"
    probes.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "RSS_PROBE_DIR": str(probes),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE / "rss_probe"), os.environ.get("PYTHONPATH")]))}
    try:
        start, cpu_before = time.time(), children_cpu()
        done = subprocess.run(command(steps, out), env=env, cwd=scratch, capture_output=True, text=True, timeout=600)
        wall, cpu = time.time() - start, children_cpu() - cpu_before
        if done.returncode:
            raise RuntimeError(f"{' '.join(command(steps, out))} failed:\n{done.stderr[-3000:]}")
        intervals = log_intervals(out, args.log_every)
        per_step = statistics.median(sec / (b - a) for a, b, sec in intervals) if intervals else float("nan")
        return Run(wall, cpu, loop_start(out) - start, per_step, intervals, peak_rss(probes))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def children_cpu() -> float:
    """CPU seconds of all finished (waited-for) descendants; less disturbed by other load than wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def loop_start(out: Path) -> float:
    """Wall-clock time of the first step: the hand-written loop's stamp, or the runner's announce log line."""
    stamp = out / "loop_start"
    if stamp.exists():
        return float(stamp.read_text())
    for line in (out / "runner.log").read_text().splitlines():
        if "global batch" in line:
            when, millis = line[1:24].split(",")  # "[2024-01-31 12:00:00,123]..."
            return time.mktime(time.strptime(when, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
    raise RuntimeError(f"no 'global batch' line in {out / 'runner.log'}")


def log_intervals(out: Path, window: int) -> list[tuple[int, int, float]]:
    """(step a, step b, seconds) between the `train/loss` events of steps that are multiples of `window`."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    points = []
    for events in sorted((out / "tensorboard").glob("events.*")):
        for event in EventFileLoader(str(events)).Load():
            if event.step % window == 0 and any(v.tag == "train/loss" for v in event.summary.value):
                points.append((event.step, event.wall_time))
    points.sort()
    return [(a, b, tb - ta) for (a, ta), (b, tb) in zip(points, points[1:]) if b > a]


def peak_rss(probes: Path) -> dict[str, float]:
    """Max RSS per role: `rank k` for workers, `main` for the process that was launched."""
    peaks: dict[str, float] = {}
    entries = [json.loads(f.read_text()) for f in probes.glob("*.json")]
    for entry in entries:
        role = f"rank {entry['rank']}" if entry["rank"] is not None and len(entries) > 1 else "main"
        peaks[role] = max(peaks.get(role, 0.0), entry["max_rss_mb"])
    return dict(sorted(peaks.items()))


# -- A/B pairs and their summary ----------------------------------------------------------------------

def wait_for_quiet(below: float, at_most: float) -> float:
    """Before a round, wait up to `at_most` seconds for the 1-minute load to fall below `below` (0: do not wait):
    other people's work on a shared machine comes and goes. Returns the load the round starts at."""
    deadline = time.monotonic() + at_most
    while below and os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def ab_pairs(cases: dict[str, Command], args: argparse.Namespace) -> dict[str, list[list[Run]]]:
    """For each pair: every case at N1, then every case at N2, in the same order. -> case -> [[run N1, run N2]]."""
    results: dict[str, list[list[Run]]] = {name: [] for name in cases}
    for pair in range(args.pairs):
        load = wait_for_quiet(args.wait_load, args.wait_max)
        print(f"  pair {pair + 1}/{args.pairs}: load {load:.2f}", flush=True)
        for name in cases:
            results[name].append([])
        for steps in args.steps:
            for name, command in cases.items():
                run = run_once(command, steps, args)
                results[name][pair].append(run)
                print(f"  pair {pair + 1}/{args.pairs} {name:>14} N={steps:<5} wall {run.wall:6.2f}s  "
                      f"cpu {run.cpu:6.2f}s  start-up {run.startup:5.2f}s  "
                      f"in-run {run.step_inrun * 1e3:6.3f} ms/step", flush=True)
    return results


def per_pair(runs: list[list[Run]], args: argparse.Namespace) -> dict[str, list]:
    """Per-pair numbers of one case: per-step (difference, in-run), start-up, fixed cost, peak RSS."""
    n1, n2 = args.steps
    diff = [(b.wall - a.wall) / (n2 - n1) for a, b in runs]
    return {
        "step_diff": diff,
        "step_inrun": [b.step_inrun for _, b in runs],
        "cpu_diff": [(b.cpu - a.cpu) / (n2 - n1) for a, b in runs],
        "startup": [r.startup for pair in runs for r in pair],
        "fixed": [a.wall - n1 * d for (a, _), d in zip(runs, diff)],
        "rss_mb": {role: [r.rss_mb.get(role, 0.0) for pair in runs for r in pair] for role in runs[0][1].rss_mb},
    }


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """'median (min-max)' of `values` times `scale`."""
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def rss_text(rss: dict[str, list[float]]) -> str:
    return " / ".join(f"{role} {statistics.median(v):.0f}" for role, v in rss.items())


# -- suites -------------------------------------------------------------------------------------------

def suite_cli(args: argparse.Namespace) -> SuiteResult:
    """Wall time of commands that start, compose the config and exit, alternated `--cli-repeats` times."""
    commands = {"python -m runner --cfg job": [PY, "-m", "runner", "--cfg", "job"],
                "python -m runner --help": [PY, "-m", "runner", "--help"],
                "python -c 'import torch' (reference)": [PY, "-c", "import torch"]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.cli_repeats):
            for name, command in commands.items():
                start = time.time()
                subprocess.run(command, cwd=cwd, env=env, capture_output=True, check=True, timeout=120)
                times[name].append(time.time() - start)
    rows = [f"| `{name}` | {spread(t)} |" for name, t in times.items()]
    return "\n".join(["| command | wall s, median (min-max) |", "|---|---|", *rows]), times


def suite_step(args: argparse.Namespace) -> SuiteResult:
    """The runner against the hand-written loop, per process count; with `--snapshots`, each snapshot's runner
    against it, all of them alternated in each pair."""
    if args.snapshots:
        return snapshots_vs_hand(args)
    return runner_vs_hand(args, "step", runner_cmd, handwritten_cmd)


def snapshots_vs_hand(args: argparse.Namespace) -> SuiteResult:
    """Per process count: each snapshot's runner and the hand-written loop in every pair; ratios to the hand per pair."""
    rows, data = [], {}
    for procs in args.procs:
        print(f"step suite: {procs} process(es), snapshots {' '.join(s.name for s in args.snapshots)} and hand",
              flush=True)
        cases = {snap.name: runner_cmd(args, procs, snapshot=snap) for snap in args.snapshots}
        raw = ab_pairs({**cases, "handwritten": handwritten_cmd(args, procs)}, args)
        runs = {name: per_pair(pairs, args) for name, pairs in raw.items()}
        data[f"{procs} process(es)"] = runs
        h = runs["handwritten"]
        for name in [*cases, "handwritten"]:
            r = runs[name]
            rows.append(
                f"| {procs} | {name} | {spread(r['step_inrun'], 1e3, 3)} "
                f"| **{spread(ratios(r['step_inrun'], h['step_inrun']), digits=3)}** "
                f"| {spread(r['step_diff'], 1e3, 3)} | {spread(ratios(r['step_diff'], h['step_diff']), digits=3)} "
                f"| {spread(ratios(r['cpu_diff'], h['cpu_diff']), digits=3)} | {spread(r['startup'])} "
                f"| **{spread([a - b for a, b in zip(r['startup'], h['startup'])])}** | {spread(r['fixed'])} |")
    header = ("| procs | code | ms/step (in-run) | / hand (in-run) | ms/step (diff) | / hand (diff) | / hand (CPU) "
              "| start-up s | start-up - hand s | fixed s |")
    return "\n".join([header, "|" + "---|" * 10, *rows]), data


def suite_fsdp(args: argparse.Namespace) -> SuiteResult:
    """strategy=fsdp against the hand-written loop sharded the same way (handwritten.py --fsdp)."""
    return runner_vs_hand(args, "fsdp", lambda a, procs: runner_cmd(a, procs, strategy="fsdp"),
                          lambda a, procs: handwritten_cmd(a, procs, fsdp=True))


# ~50M parameters (12 x 2048 x 2048 + the ends) trained with AdamW: two moments per parameter.
MEMORY_JOB = ["model.hidden=2048", "model.depth=12", "data.num_features=64", "data.num_classes=10",
              "data.batch_size=16", "optimizer=adamw", "trainer.limit_val_batches=0"]


def suite_fsdp_memory(args: argparse.Namespace) -> SuiteResult:
    """Peak RSS per process of strategy=fsdp against strategy=ddp on the ~50M-parameter job, A B A B."""
    rows, data = [], {}
    for procs in args.procs:
        print(f"fsdp_memory suite: {procs} process(es)", flush=True)
        cases = {strategy: runner_cmd(args, procs, strategy=strategy, job=MEMORY_JOB) for strategy in ("fsdp", "ddp")}
        raw = ab_pairs(cases, args)
        f, d = (per_pair(raw[name], args) for name in cases)
        data[f"{procs} process(es)"] = {"fsdp": f, "ddp": d}
        for role in f["rss_mb"]:
            rows.append(f"| {procs} | {role} | {spread(f['rss_mb'][role], digits=0)} | {spread(d['rss_mb'][role], digits=0)} "
                        f"| **{spread(ratios(f['rss_mb'][role], d['rss_mb'][role]), digits=3)}** "
                        f"| {spread(f['step_inrun'], 1e3, 0)} | {spread(d['step_inrun'], 1e3, 0)} |")
    header = ("| procs | process | fsdp max RSS MB | ddp max RSS MB | fsdp / ddp | fsdp ms/step (in-run) "
              "| ddp ms/step (in-run) |")
    return "\n".join([header, "|" + "---|" * 7, *rows]), data


def suite_lm(args: argparse.Namespace) -> SuiteResult:
    """`experiment=charlm` (task=language_model) against benchmarks/handwritten_lm.py, per process count."""
    return runner_vs_hand(args, "lm", lm_runner_cmd, lm_handwritten_cmd)


def runner_vs_hand(args: argparse.Namespace, suite: str, runner: Callable[[argparse.Namespace, int], Command],
                   hand: Callable[[argparse.Namespace, int], Command]) -> SuiteResult:
    """Per process count: per-step time, start-up, fixed cost and memory of the runner and the hand-written loop."""
    rows, data = [], {}
    for procs in args.procs:
        print(f"{suite} suite: {procs} process(es)", flush=True)
        raw = ab_pairs({"runner": runner(args, procs), "handwritten": hand(args, procs)}, args)
        r, h = (per_pair(raw[name], args) for name in ("runner", "handwritten"))
        data[f"{procs} process(es)"] = {"runner": r, "handwritten": h}
        rows.append(
            f"| {procs} | {spread(r['step_diff'], 1e3, 3)} | {spread(h['step_diff'], 1e3, 3)} "
            f"| **{spread(ratios(r['step_diff'], h['step_diff']), digits=3)}** "
            f"| {spread(r['step_inrun'], 1e3, 3)} | {spread(h['step_inrun'], 1e3, 3)} "
            f"| **{spread(ratios(r['step_inrun'], h['step_inrun']), digits=3)}** "
            f"| {spread(ratios(r['cpu_diff'], h['cpu_diff']), digits=3)} "
            f"| {spread(r['startup'])} | {spread(h['startup'])} "
            f"| **{spread([a - b for a, b in zip(r['startup'], h['startup'])])}** "
            f"| {spread(r['fixed'])} | {spread(h['fixed'])} | {rss_text(r['rss_mb'])} | {rss_text(h['rss_mb'])} |")
    header = ("| procs | runner ms/step (diff) | hand ms/step (diff) | ratio (diff) | runner ms/step (in-run) "
              "| hand ms/step (in-run) | ratio (in-run) | ratio (CPU) | runner start-up s | hand start-up s "
              "| start-up delta s | runner fixed s | hand fixed s | runner max RSS MB | hand max RSS MB |")
    return "\n".join([header, "|" + "---|" * 15, *rows]), data


def suite_logging(args: argparse.Namespace) -> SuiteResult:
    """Logging every step against every `--log-every` steps: the runner, and the hand-written loop alike."""
    rows, data = [], {}
    for procs in args.procs:
        print(f"logging suite: {procs} process(es)", flush=True)
        cases = {"runner every 1": runner_cmd(args, procs, log_every=1), "runner default": runner_cmd(args, procs),
                 "hand every 1": handwritten_cmd(args, procs, log_every=1),
                 "hand default": handwritten_cmd(args, procs)}
        runs = {name: per_pair(raw, args) for name, raw in ab_pairs(cases, args).items()}
        data[f"{procs} process(es)"] = runs
        for who in ("runner", "hand"):
            every, default = runs[f"{who} every 1"], runs[f"{who} default"]
            rows.append(
                f"| {procs} | {who} | {spread(every['step_diff'], 1e3, 3)} | {spread(default['step_diff'], 1e3, 3)} "
                f"| **{spread(ratios(every['step_diff'], default['step_diff']), digits=3)}** "
                f"| {spread(ratios(every['step_inrun'], default['step_inrun']), digits=3)} "
                f"| {spread(ratios(every['cpu_diff'], default['cpu_diff']), digits=3)} |")
    header = (f"| procs | loop | every step ms/step (diff) | every {args.log_every} ms/step (diff) | ratio (diff) "
              "| ratio (in-run) | ratio (CPU) |")
    return "\n".join([header, "|" + "---|" * 7, *rows]), data


def save_cost(runs: list[list[Run]], every: int) -> list[float]:
    """Per N2 run: median log interval that follows a save minus the median one that does not (seconds)."""
    costs = []
    for _, run in runs:
        after = [sec for a, _, sec in run.intervals if a % every == 0]
        plain = [sec for a, _, sec in run.intervals if a % every]
        costs.append(statistics.median(after) - statistics.median(plain) if after and plain else float("nan"))
    return costs


def suite_ckpt(args: argparse.Namespace) -> SuiteResult:
    """Checkpoints every `--ckpt-every` steps through checkpoint_io=torch and =async, against none."""
    rows, data = [], {}
    every = f"trainer.ckpt_every_n_steps={args.ckpt_every}"
    for procs in args.procs:
        print(f"checkpoint suite: {procs} process(es)", flush=True)
        cases = {"none": runner_cmd(args, procs), "torch": runner_cmd(args, procs, "checkpoint_io=torch", every),
                 "async": runner_cmd(args, procs, "checkpoint_io=async", every)}
        raw = ab_pairs(cases, args)
        base = per_pair(raw["none"], args)
        data[f"{procs} process(es)"] = {"none": base}
        for name in ("torch", "async"):
            r = per_pair(raw[name], args)
            data[f"{procs} process(es)"][name] = {**r, "save_cost": save_cost(raw[name], args.ckpt_every)}
            rows.append(
                f"| {procs} | {name} | {spread(r['step_diff'], 1e3, 3)} | {spread(base['step_diff'], 1e3, 3)} "
                f"| **{spread(ratios(r['step_diff'], base['step_diff']), digits=3)}** "
                f"| {spread(ratios(r['cpu_diff'], base['cpu_diff']), digits=3)} "
                f"| {spread(save_cost(raw[name], args.ckpt_every), 1e3, 1)} |")
    header = ("| procs | checkpoint_io | ms/step with saves (diff) | ms/step no saves (diff) | ratio (diff) "
              f"| ratio (CPU) | extra ms in the {args.log_every} steps after a save (in-run) |")
    return "\n".join([header, "|" + "---|" * 7, *rows]), data


def suite_compile(args: argparse.Namespace) -> SuiteResult:
    """The runner with `trainer.compile=true` against without, and both against the hand-written loop."""
    rows, data = [], {}
    for procs in args.procs:
        print(f"compile suite: {procs} process(es)", flush=True)
        cases = {"compiled": runner_cmd(args, procs, "trainer.compile=true"), "eager": runner_cmd(args, procs),
                 "handwritten": handwritten_cmd(args, procs)}
        raw = ab_pairs(cases, args)
        c, e, h = (per_pair(raw[name], args) for name in cases)
        data[f"{procs} process(es)"] = {"compiled": c, "eager": e, "handwritten": h}
        rows.append(
            f"| {procs} | {spread(c['step_inrun'], 1e3, 3)} | {spread(e['step_inrun'], 1e3, 3)} "
            f"| **{spread(ratios(c['step_inrun'], e['step_inrun']), digits=3)}** "
            f"| {spread(ratios(c['step_inrun'], h['step_inrun']), digits=3)} "
            f"| {spread(ratios(c['cpu_diff'], e['cpu_diff']), digits=3)} "
            f"| {spread(c['fixed'])} | {spread(e['fixed'])} |")
    header = ("| procs | compiled ms/step (in-run) | eager ms/step (in-run) | compiled / eager (in-run) "
              "| compiled / hand (in-run) | compiled / eager (CPU) | compiled fixed s | eager fixed s |")
    return "\n".join([header, "|" + "---|" * 8, *rows]), data


def suite_versions(args: argparse.Namespace) -> SuiteResult:
    """The same runner job from two or more code snapshots, logging every step and every `--log-every` steps."""
    if len(args.snapshots) < 2:
        sys.exit("--suite versions needs --snapshots A B [...]: folders holding runner/ and conf/")
    rows, data = [], {}
    for procs in args.procs:
        print(f"versions suite: {procs} process(es)", flush=True)
        cases = {f"{snap.name} every {every}": runner_cmd(args, procs, log_every=every, snapshot=snap)
                 for every in (1, args.log_every) for snap in args.snapshots}
        runs = {name: per_pair(raw, args) for name, raw in ab_pairs(cases, args).items()}
        data[f"{procs} process(es)"] = runs
        for every in (1, args.log_every):
            first = runs[f"{args.snapshots[0].name} every {every}"]
            for snap in args.snapshots:
                r = runs[f"{snap.name} every {every}"]
                rows.append(
                    f"| {procs} | {every} | {snap.name} | {spread(r['step_diff'], 1e3, 3)} "
                    f"| {spread(r['step_inrun'], 1e3, 3)} "
                    f"| **{spread(ratios(r['step_inrun'], first['step_inrun']), digits=3)}** "
                    f"| {spread(ratios(r['step_diff'], first['step_diff']), digits=3)} "
                    f"| {spread(ratios(r['cpu_diff'], first['cpu_diff']), digits=3)} |")
    header = ("| procs | log every | snapshot | ms/step (diff) | ms/step (in-run) | ratio to the first (in-run) "
              "| ratio (diff) | ratio (CPU) |")
    return "\n".join([header, "|" + "---|" * 8, *rows]), data


def main() -> None:
    args = parse_args()
    if max(args.steps) % args.log_every or min(args.steps) >= max(args.steps):
        sys.exit(f"--steps N1 N2 needs N1 < N2 and N2 a multiple of --log-every={args.log_every}")
    suites = {"cli": suite_cli, "step": suite_step, "logging": suite_logging, "ckpt": suite_ckpt,
              "compile": suite_compile, "versions": suite_versions, "lm": suite_lm, "fsdp": suite_fsdp,
              "fsdp_memory": suite_fsdp_memory}
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()}; OMP_NUM_THREADS={args.threads}; "
          f"steps N1={args.steps[0]} N2={args.steps[1]}; {args.pairs} pairs; accelerator={args.accelerator}",
          flush=True)
    results = {}
    for name in args.suite:
        started = time.time()
        table, results[name] = suites[name](args)
        print(f"\n## {name} ({time.time() - started:.0f} s, load {os.getloadavg()})\n\n{table}\n", flush=True)
    if args.json:
        meta = {k: str(v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
