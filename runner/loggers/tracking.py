"""What the MLflow and W&B loggers read from the run folder: which job this is, its settings, its saved run id.

Hydra writes `.hydra/hydra.yaml` (the job's name, number and mode) and the runner `.hydra/resolved.yaml` (the
settings the workers build from) before any worker starts; both are read as plain YAML, nothing resolved.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

CUT_MARKER = "...[cut]"


@dataclass(frozen=True)
class Job:
    """One Hydra job as a tracking service should file it."""

    run_dir: Path
    name: str  # hydra.job.name
    stage: str
    sweep_dir: Optional[Path] = None  # the sweep folder of a `-m` job
    number: Optional[int] = None  # hydra.job.num within the sweep

    @property
    def store_dir(self) -> Path:
        """Where runs are kept: the folder that holds the run (or sweep) folder, above Hydra's date folder."""
        return _output_root(self.sweep_dir or self.run_dir)

    @property
    def group(self) -> str:
        """The sweep folder (or the run folder) as a name, relative to where runs are kept: `2026-01-31/12-00-00`."""
        return _relative_name(self.sweep_dir or self.run_dir, self.store_dir)

    @property
    def run_name(self) -> str:
        return _relative_name(self.run_dir, self.store_dir)


def read_job(run_dir: str) -> Job:
    """The job whose run folder is `run_dir` (a folder without `.hydra/`, e.g. a scratch one, is a plain run)."""
    root = Path(run_dir).resolve()
    hydra = _load(root / ".hydra" / "hydra.yaml").get("hydra") or {}
    settings = read_settings(run_dir)
    job = hydra.get("job") or {}
    name, stage = str(job.get("name") or "runner"), str(settings.get("stage") or "fit")
    if hydra.get("mode") != "MULTIRUN":
        return Job(root, name, stage)
    sweep = str((hydra.get("sweep") or {}).get("dir") or "")
    # The saved sweep.dir may still be an interpolation (resolving it again could name a new folder).
    sweep_dir = Path(sweep).resolve() if sweep and "${" not in sweep and Path(sweep).is_dir() else root.parent
    number = job.get("num")
    return Job(root, name, stage, sweep_dir, int(number) if isinstance(number, int) else None)


def read_settings(run_dir: str) -> dict:
    """The job's resolved config (`.hydra/resolved.yaml`), or {} where the folder has none."""
    return _load(Path(run_dir) / ".hydra" / "resolved.yaml")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"trainer.max_steps": 10, ...}: nested settings as dotted keys."""
    if isinstance(tree, Mapping) and tree:
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree} if prefix else {}


def cut(text: str, limit: int) -> str:
    """`text`, or its start and a marker when it is longer than `limit` characters."""
    return text if len(text) <= limit else text[: limit - len(CUT_MARKER)] + CUT_MARKER


def read_saved_run(path: Path) -> dict:
    """What an earlier attempt of this job saved about its tracking run ({} when nothing usable is there)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def save_run(path: Path, record: Mapping[str, Any]) -> None:
    """Written through a temporary file and a rename: a killed process leaves the old record or the new one."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(dict(record), indent=2) + "\n")
    os.replace(tmp, path)


def _load(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _output_root(folder: Path) -> Path:
    parent = folder.parent
    return parent.parent if re.fullmatch(r"\d{4}-\d{2}-\d{2}", parent.name) else parent


def _relative_name(folder: Path, root: Path) -> str:
    try:
        return folder.relative_to(root).as_posix()
    except ValueError:
        return folder.name
