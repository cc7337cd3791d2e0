"""Where a one-process run's start-up goes: `python -m runner` with timers around its pieces, in one process.

Imports hydra, runner.cli and torch first (each timed), then wraps Hydra's compositions, the job's
checks and the worker's builds with a timer and runs the CLI with the given overrides. Prints, per
piece, when it started (seconds since this script started) and how long it took. Timers cost
microseconds; the order of imports differs from a plain run (torch before composition), not their sum.

    OMP_NUM_THREADS=1 python benchmarks/startup_pieces.py model.hidden=512 model.depth=4 optimizer=sgd \\
        accelerator=cpu strategy=single trainer.devices=1 trainer.max_steps=1 hydra.run.dir=/tmp/pieces
"""

from __future__ import annotations

import atexit
import sys
import time
from typing import Any

T0 = time.perf_counter()
pieces: list[tuple[str, float, float]] = []  # (name, start, seconds)


def timed(owner: Any, name: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            pieces.append((f"{getattr(owner, '__name__', owner)}.{name}", start - T0, time.perf_counter() - start))

    setattr(owner, name, wrapper)


def timed_import(module: str) -> None:
    start = time.perf_counter()
    __import__(module)
    pieces.append((f"import {module}", start - T0, time.perf_counter() - start))


def report() -> None:
    for name, start, seconds in sorted(pieces, key=lambda piece: piece[1]):
        print(f"{start:7.3f} s  {seconds:6.3f} s  {name}", file=sys.stderr)


def main() -> None:
    for module in ("hydra", "runner.cli", "torch", "runner.job"):
        timed_import(module)
    from hydra._internal.hydra import Hydra

    from runner import build, checks, worker
    from runner.loop import Loop, loop as fit_loop

    for name in ("get_mode", "compose_config", "run"):
        timed(Hydra, name)
    timed(checks, "validate_plan")  # runner.job imports it where it calls it
    for name in ("build_strategy", "build_model", "build_optimizer", "build_data", "build_logger", "build_scheduler"):
        timed(build, name)
    for name in ("configure_logging", "train_loader", "val_loader"):
        timed(worker, name)
    timed(fit_loop, "announce")  # starts at the first step
    timed(Loop, "_finish")
    atexit.register(report)
    sys.argv = ["runner", *sys.argv[1:]]
    sys.modules["runner.cli"].main()


if __name__ == "__main__":
    main()
