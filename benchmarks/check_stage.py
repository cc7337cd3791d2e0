"""`python -m runner stage=check` against `python -m runner trainer.fast_dev_run=true`, side by side: whole processes,
start-up included, alternated (A B A B ..., the order flipped every other round) so drift on a shared machine hits
both alike. Wall seconds (a monotonic clock around the child) and CPU seconds (user + system of the finished child,
the operating system's accounting), min / median / max over the rounds; quote the medians, and the ratio check /
fast_dev_run of each round's pair (median of the ratios).

The issue's target: stage=check takes at most 0.5 x the wall time of fast_dev_run on the default config.

`--snapshot DIR` (repeatable) also times stage=check of other code: a folder holding runner/ and conf/ (e.g.
`git archive <commit> | tar -x -C /tmp/snap`), put first on PYTHONPATH for its runs; the working tree is `.`.
Every run starts in a scratch folder (so that `python -m` imports the code asked for) and fast_dev_run writes its
run folder there.

    python benchmarks/check_stage.py --rounds 10
    python benchmarks/check_stage.py --rounds 8 --snapshot /tmp/snap-head   # before (HEAD) and after (working tree)
    python benchmarks/check_stage.py --rounds 5 experiment=charlm           # another config: extra overrides
    python benchmarks/check_stage.py --sweep 3                              # also every experiment in one -m

`--sweep N` also times `python -m runner -m stage=check 'experiment=glob(*)'` N times, each beside a process that
imports what the check imports and nothing more: seconds per config after the imports are (sweep - imports) / configs;
the summary's own wall_time_s of each job (its check, composition excluded) is reported too.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _timed(command: list[str], **kwargs: Any) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall, cpu) seconds of one child process, and what it returned."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, **kwargs)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done


def run_once(code: Path, overrides: list[str]) -> tuple[float, float]:
    """(wall, cpu) seconds of one `python -m runner <overrides>` with `code` first on PYTHONPATH."""
    scratch = Path(tempfile.mkdtemp(prefix="check-stage-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "runner", *overrides]
    if "stage=check" not in overrides:
        command.append(f"hydra.run.dir={scratch / 'run'}")
    try:
        wall, cpu, done = _timed(command, env=env, cwd=scratch)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} (code {code}) failed:\n{done.stderr[-3000:]}")
        return wall, cpu
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


_IMPORTS = "import runner.cli, runner.job, runner.sweep, runner.checks.dry_run, runner.checks.schedule"


def time_sweep() -> dict:
    """The experiments' check sweep and its imports alone, each (wall, cpu), and each job's own wall_time_s."""
    scratch = Path(tempfile.mkdtemp(prefix="check-sweep-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        *imports, _ = _timed([sys.executable, "-c", _IMPORTS], env=env, cwd=scratch)
        *sweep, done = _timed([sys.executable, "-m", "runner", "-m", "stage=check", "experiment=glob(*)",
                               f"hydra.sweep.dir={scratch / 'sweep'}"], env=env, cwd=scratch)
        summary = scratch / "sweep" / "summary.csv"
        rows = list(csv.DictReader(summary.open())) if summary.exists() else []
        if done.returncode or not rows or any(r["status"] != "ok" for r in rows):
            raise RuntimeError(f"the experiments' check sweep failed:\n{done.stderr[-3000:]}")
        return {"sweep": sweep, "imports": imports, "jobs": {r["overrides"]: float(r["wall_time_s"]) for r in rows}}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def report_sweeps(sweeps: list[dict]) -> None:
    configs = len(sweeps[0]["jobs"])
    for column, label in ((0, "wall"), (1, "cpu")):
        per_config = [(s["sweep"][column] - s["imports"][column]) / configs for s in sweeps]
        print(f"check sweep of {configs} experiments, {label}: {spread([s['sweep'][column] for s in sweeps])}, its "
              f"imports alone {spread([s['imports'][column] for s in sweeps])}; per config after the imports "
              f"{spread(per_config)}")
    for job in sweeps[0]["jobs"]:
        print(f"  {job}: wall_time_s {spread([s['jobs'][job] for s in sweeps])}")


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--snapshot", action="append", default=[], help="a folder with runner/ and conf/ (repeatable)")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    p.add_argument("--sweep", type=int, default=0, help="also time the experiments' check sweep this many times")
    p.add_argument("overrides", nargs="*", help="overrides for both commands (default: the default config)")
    args = p.parse_args()
    variants: dict[str, tuple[Path, list[str]]] = {
        "check": (REPO, ["stage=check", *args.overrides]),
        "fast_dev_run": (REPO, ["trainer.fast_dev_run=true", *args.overrides]),
    }
    for snapshot in args.snapshot:
        variants[f"check@{snapshot}"] = (Path(snapshot).resolve(), ["stage=check", *args.overrides])
    names = list(variants)
    run_once(*variants["fast_dev_run"])  # warm-up, not counted: the page cache, .pyc files
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            runs[name].append(run_once(*variants[name]))
        print(f"round {round_ + 1}: " + "  ".join(f"{n} {r[-1][0]:.2f}s/{r[-1][1]:.2f}s cpu" for n, r in runs.items()),
              flush=True)
    print(f"{args.rounds} rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end")
    for name in names:
        print(f"{name:>14}: wall {spread([w for w, _ in runs[name]])}  cpu {spread([c for _, c in runs[name]])}")
    for name in (n for n in names if n.startswith("check")):
        for column, label in ((0, "wall"), (1, "cpu")):
            ratios = [a[column] / b[column] for a, b in zip(runs[name], runs["fast_dev_run"])]
            print(f"{name} / fast_dev_run, {label}: {spread(ratios)}")
    sweeps = [time_sweep() for _ in range(args.sweep)]
    if sweeps:
        report_sweeps(sweeps)
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "overrides": args.overrides,
                                         "runs": {n: [{"wall": w, "cpu": c} for w, c in r] for n, r in runs.items()},
                                         "sweeps": sweeps},
                                        indent=1))


if __name__ == "__main__":
    main()
