"""Start-up of two or more code snapshots of the runner, alternated: launch -> the loop's first step.

Each snapshot is a folder holding `runner/` and `conf/` (e.g. `git archive <commit> | tar -x -C /tmp/snap`),
put first on PYTHONPATH for its runs, so edits to the working tree cannot get in. `--hand` adds the
hand-written script (benchmarks/handwritten.py of the first snapshot) as one more variant.

    python benchmarks/startup_ab.py /tmp/snap-a /tmp/snap-b --procs 1 --pairs 16
    python benchmarks/startup_ab.py /tmp/snap-a /tmp/snap-b --procs 2 --pairs 6 --hand
    python benchmarks/startup_ab.py /tmp/snap-a /tmp/snap-b --procs 2 --pairs 10 --hand --wait-load 2.5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

# The same job as every other suite (this folder is on sys.path).
from compare import JOB as BENCHMARK_JOB, wait_for_quiet

JOB = [*BENCHMARK_JOB, "accelerator=cpu", "trainer.max_steps=20", "trainer.log_every_n_steps=50"]


def first_step(out: Path) -> float:
    """The wall-clock time of the runner's `global batch ...` line, logged just before the first step."""
    line = next(line for line in (out / "runner.log").read_text().splitlines() if "global batch" in line)
    return datetime.strptime(re.match(r"\[(.*?)\]", line).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def command(variant: str, procs: int, hand_script: Path, out: Path) -> list[str]:
    if variant == "hand":
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        return [*(launch if procs > 1 else [sys.executable]), str(hand_script), "--steps", "20", "--out", str(out)]
    strategy = f"strategy={'ddp' if procs > 1 else 'single'}"
    return [sys.executable, "-m", "runner", *JOB, strategy, f"trainer.devices={procs}", f"hydra.run.dir={out}"]


def start_up(variant: str, procs: int, hand_script: Path) -> float:
    scratch = Path(tempfile.mkdtemp(prefix="startup-"))
    out = scratch / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if variant != "hand":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [variant, os.environ.get("PYTHONPATH")]))
    try:
        launched = time.time()
        done = subprocess.run(command(variant, procs, hand_script, out), env=env, cwd=scratch, capture_output=True,
                              text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
        started = float((out / "loop_start").read_text()) if variant == "hand" else first_step(out)
        return started - launched
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} (min {min(values):.{digits}f}, max {max(values):.{digits}f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("snapshots", nargs="+", help="folders with runner/ and conf/")
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--hand", action="store_true", help="also time benchmarks/handwritten.py")
    p.add_argument("--wait-load", type=float, default=0.0, help="before each pair, wait for the 1-minute load to "
                   "fall below this (0: do not wait)")
    p.add_argument("--wait-max", type=float, default=300.0, help="seconds to wait for it at most")
    p.add_argument("--json", type=Path, default=None, help="write every round's figures here")
    args = p.parse_args()
    variants = [str(Path(s).resolve()) for s in args.snapshots] + (["hand"] if args.hand else [])
    hand_script = Path(variants[0]) / "benchmarks" / "handwritten.py"
    times: dict[str, list[float]] = {v: [] for v in variants}
    loads: list[float] = []
    print(f"{args.procs} process(es), {args.pairs} pairs, OMP_NUM_THREADS=1, load {os.getloadavg()}", flush=True)
    for pair in range(args.pairs):
        loads.append(wait_for_quiet(args.wait_load, args.wait_max))
        order = variants if pair % 2 == 0 else variants[::-1]
        for variant in order:
            times[variant].append(start_up(variant, args.procs, hand_script))
        print(f"pair {pair + 1} (load {loads[-1]:.2f}): " + "  ".join(f"{v} {t[-1]:.3f}s" for v, t in times.items()),
              flush=True)
    for variant, t in times.items():
        print(f"{variant}: median {spread(t)} s")
    if args.hand:  # per round: each runner's start-up less the hand-written loop's, and their ratio
        for variant in variants[:-1]:
            deltas = [a - b for a, b in zip(times[variant], times["hand"])]
            ratios = [a / b for a, b in zip(times[variant], times["hand"])]
            print(f"{variant} - hand, per round: {spread(deltas)} s; / hand: {spread(ratios)}")
    print(f"load per round: {spread(loads, 2)}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "startup_s": times,
                                         "load": loads}, indent=1) + "\n")


if __name__ == "__main__":
    main()
