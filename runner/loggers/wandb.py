"""`logger=wandb`: one Weights & Biases run per job, offline by default, its files in the run folder.

Offline runs land in `<run folder>/wandb/offline-run-*`; `wandb sync <run folder>/wandb/offline-run-*` uploads
them later. The run starts with the first thing to log (the checks before any worker starts build the logger in a
scratch folder and must not leave a run behind), and ends with `finish()`, so each job of a sweep is its own run.
"""

from __future__ import annotations

import html
import logging
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from runner.loggers.base import flat_params
from runner.loggers.media import histogram, hwc_array
from runner.loggers.tracking import read_job, read_saved_run, read_settings, save_run

log = logging.getLogger("runner")
RUN_RECORD = "wandb_run.json"
MODES = ("offline", "online", "disabled")
INSTALL = "logger=wandb needs the wandb package: pip install 'runner[wandb]' (or pip install wandb)"


def _import_wandb() -> Any:
    try:
        import wandb  # imported only when this logger is chosen
    except ImportError as error:
        raise ImportError(f"{INSTALL} ({error})") from error
    return wandb


class WandbLogger:
    """Metrics at their steps, the resolved config as the run's config, the final metrics as its summary."""

    def __init__(self, root_dir: str, project: str = "runner", entity: Optional[str] = None,
                 mode: Optional[str] = None, name: Optional[str] = None, group: Optional[str] = None,
                 job_type: Optional[str] = None, tags: Optional[Sequence[str]] = None,
                 notes: Optional[str] = None) -> None:
        mode = mode or os.environ.get("WANDB_MODE") or "offline"  # W&B's own variable, when the setting is null
        if mode not in MODES:
            raise ValueError(f"mode={mode} is not allowed: use offline (the default), online or disabled")
        if tags is not None and (isinstance(tags, (str, Mapping)) or not all(isinstance(t, str) for t in tags)):
            raise ValueError(f"tags={tags} must be a list of strings, e.g. [baseline, cpu]")
        if not (isinstance(project, str) and project):
            raise ValueError(f"project={project} must name a W&B project")
        self._wandb = _import_wandb()
        _check_project(self._wandb, project)
        self.root = Path(root_dir)
        self.job = read_job(root_dir)
        self.mode, self.project, self.entity, self.notes = mode, project, entity, notes
        self.name = name or self.job.run_name
        self.group = group or self.job.group
        self.job_type = job_type or self.job.stage
        self.tags = list(tags or [])
        self.run: Any = None
        self._start_failed = False  # a failed start is not tried again (each try can wait on the service)
        self._resumed = False
        self._logged: set[str] = set()
        self._last_step = 0

    def check_service(self) -> list[str]:
        """Online mode needs a key, found before training rather than as a traceback at the first log."""
        if self.mode != "online" or os.environ.get("WANDB_API_KEY") or _netrc_key():
            return []
        return ["mode=online needs a W&B API key: run `wandb login` or set WANDB_API_KEY (the default "
                "mode=offline keeps the run in the run folder, for `wandb sync` later)"]

    def _start(self) -> None:
        saved = read_saved_run(self.root / RUN_RECORD)
        arguments: dict[str, Any] = {}
        if saved.get("id") and saved.get("mode") == "online" == self.mode:
            arguments = {"id": saved["id"], "resume": "allow"}
            log.info("W&B: continuing run %s", saved["id"])
        elif saved.get("id") and self._resumed:
            log.warning("W&B cannot resume offline run %s: this attempt is a new run in group %s (wandb sync "
                        "uploads both)", saved["id"], self.group)
        if self.mode != "online":
            # The process-wide settings too: W&B's own usage telemetry goes by them, not by init's mode.
            self._wandb.setup(self._wandb.Settings(mode=self.mode))
        self.run = self._wandb.init(
            dir=str(self.root), project=self.project, entity=self.entity, mode=self.mode, name=self.name,
            group=self.group, job_type=self.job_type, tags=self.tags, notes=self.notes,
            config=read_settings(str(self.root)), reinit="create_new", **arguments)
        save_run(self.root / RUN_RECORD, {"id": self.run.id, "mode": self.mode, "group": self.group})
        log.info("W&B run %s (%s) in %s", self.run.id, self.mode, self.root / "wandb")

    @property
    def _active(self) -> Any:
        if self.run is None:
            if self._start_failed:
                raise RuntimeError("W&B did not start for this run (see the error above)")
            self._start_failed = True
            self._start()
            self._start_failed = False
        return self.run

    # -- Lightning's names: the run (started when first asked), the project, the folder ----------------
    @property
    def experiment(self) -> Any:
        """The W&B run (wandb.init's): `self.logger.experiment.log({...})`, `.summary`, `.config`."""
        return self._active

    @property
    def version(self) -> str:
        return self._active.id

    @property
    def save_dir(self) -> str:
        return str(self.root)

    log_dir = save_dir

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        step = self._last_step if step is None else int(step)
        self._active.log(dict(metrics), step=step)
        self._logged.update(metrics)
        self._last_step = max(self._last_step, step)

    def log_image(self, name: str, image: Any, step: int, dataformats: str = "CHW") -> None:
        self.log_metrics({name: self._wandb.Image(hwc_array(image, dataformats))}, step)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        counts, edges = histogram(values)
        self.log_metrics({name: self._wandb.Histogram(np_histogram=(counts, edges))}, step)

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        self.log_metrics({name: self._wandb.Image(figure)}, step)

    def log_text(self, name: str, text: str, step: int) -> None:
        self.log_metrics({name: self._wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step)

    def resume_at(self, step: int) -> None:
        self._resumed = True

    def log_hyperparams(self, params: Any, metrics: Optional[Mapping[str, float]] = None) -> None:
        """The final metrics as the run's summary; those no step logged join the last step's history too. The user's
        own calls (without `metrics`) add their params to the run's config at once."""
        run = self._active
        if metrics is None:
            run.config.update(flat_params(params), allow_val_change=True)
            return
        unlogged = {name: value for name, value in metrics.items() if name not in self._logged}
        if unlogged:
            self.log_metrics(unlogged, self._last_step)
        run.summary.update(dict(metrics))

    def finalize(self) -> None:
        failed = sys.exc_info()[0] is not None  # called from a `finally`: an exception is on its way out
        if self._start_failed or (self.run is None and not (self.root / ".hydra" / "resolved.yaml").is_file()):
            return  # W&B never started, or nothing was logged and this is no job's folder (the checks' build)
        self._active.finish(exit_code=1 if failed else 0)


def _check_project(wandb: Any, project: str) -> None:
    """W&B's own rule for project names (its Settings validator), before launch: W&B itself applies it at
    wandb.init, the first log, after the workers started and trained their first steps."""
    try:
        wandb.Settings(project=project)
    except wandb.errors.UsageError as error:
        entity = " (a team or user goes in logger.wandb.entity)" if "/" in project else ""
        raise ValueError(f"project={project} is not allowed: {error}{entity}") from error


def _netrc_key() -> bool:
    """Whether ~/.netrc (where `wandb login` writes) holds a key for the W&B host."""
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
