"""The run folder, its checkpoints/ and the built-in loggers' folders can take files: found before any worker
starts, not at the first log step or checkpoint. Nothing is created here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.plan import Plan


def check_writable(plan: Plan) -> list[str]:
    """A line for each folder the job will write in that cannot be written: a file stands in its way, or a folder
    this user may not write in. A plan without a run folder (a config checked alone) has none."""
    run_dir = plan.run_dir
    if run_dir is None:
        return []
    folders = [run_dir, run_dir / "checkpoints"]
    for spec in plan.loggers.values():
        root = Path(spec.get("root_dir") or run_dir)
        if spec.get("_target_") == "runner.loggers.TensorBoardLogger":
            folders.append(root / spec.get("subdir", "tensorboard"))
        elif spec.get("_target_") == "runner.loggers.CSVLogger":
            folders.append(root)
    problems = []
    for folder in dict.fromkeys(folders):
        existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
        if not existing.is_dir():
            problems.append(f"cannot write in {folder}: {existing} is a file, not a folder")
        elif not os.access(existing, os.W_OK | os.X_OK):
            problems.append(f"cannot write in {folder}: {existing} is not writable by this user")
    return problems
