"""Worker logging under Hydra's `hydra/job_logging`: the job's choice, saved by the parent, applied by each worker.

With the runner's default choice (`hydra/job_logging=runner`, Hydra's default with runner.log opened without
following a link) the workers keep the runner's own set-up (runner.log and rank_<k>.log, each line
tagged with its rank); any other choice or override of `hydra.job_logging` is applied in every worker as Hydra
applies it in the job's process, except that a rank k > 0 writes rank_<k>.log instead of the file it names.
"""

from __future__ import annotations

import errno
import json
import logging
import logging.config
import os
from pathlib import Path
from typing import Any, Optional

JOB_LOGGING_FILE = Path(".hydra") / "job_logging.json"
RUNNER_JOB_LOGGING = "runner"  # conf/hydra/job_logging/runner.yaml, chosen by conf/config.yaml


def chosen_job_logging(hydra_cfg: Any) -> Optional[dict]:
    """The job's `hydra.job_logging`, resolved, when the user changed it; None for the runner's default."""
    from omegaconf import OmegaConf

    choice = hydra_cfg.runtime.choices.get("hydra/job_logging")
    touched = any(o.lstrip("+~").startswith(("hydra.job_logging", "hydra/job_logging"))
                  for o in hydra_cfg.overrides.hydra)
    if choice == RUNNER_JOB_LOGGING and not touched:
        return None
    return OmegaConf.to_container(hydra_cfg.job_logging, resolve=True)


def save_job_logging(run_dir: Path, config: Optional[dict]) -> None:
    """What the workers of this run apply (nothing: the runner's own set-up), replacing an earlier run's choice."""
    path = run_dir / JOB_LOGGING_FILE
    if config is None:
        path.unlink(missing_ok=True)
        return
    from runner.files import write_text

    write_text(path, json.dumps(config, indent=2) + "\n")  # a link planted there is replaced, not written through


def apply_job_logging(run_dir: Path, rank: int) -> bool:
    """Apply the job's saved `hydra/job_logging` in this worker; False when there is none to apply."""
    path = run_dir / JOB_LOGGING_FILE
    if not path.exists():
        return False
    config = json.loads(path.read_text())
    if config.get("root") is None:  # hydra/job_logging=none: Hydra configures nothing, and neither does this
        return True
    if rank != 0:
        for handler in config.get("handlers", {}).values():
            if "filename" in handler:
                handler["filename"] = str(Path(handler["filename"]).with_name(f"rank_{rank}.log"))
    runner_log = logging.getLogger("runner")
    for old in runner_log.handlers:
        old.close()
    runner_log.handlers, runner_log.propagate = [], True
    logging.config.dictConfig(config)
    return True


def write_to_log_files(records: list[logging.LogRecord]) -> None:
    """Write `records`, said before this job's log files were open, into them (the root logger's files, where Hydra's
    job logging puts runner.log, and the runner logger's own), not again on the console."""
    handlers = {id(h): h for name in ("", "runner") for h in logging.getLogger(name).handlers}
    for handler in handlers.values():
        if isinstance(handler, logging.FileHandler):
            for record in records:
                if record.levelno >= handler.level:
                    handler.handle(record)


class NoFollowFileHandler(logging.FileHandler):
    """A log file opened without following a symbolic link planted at its path (O_NOFOLLOW): such a link is
    refused in one line, never written through to the file it points to."""

    def _open(self):  # noqa: ANN202 - logging.FileHandler's hook
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if "w" in self.mode else
                                                                         os.O_APPEND)
        try:
            fd = os.open(self.baseFilename, flags, 0o644)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            from runner.config import ConfigError

            raise ConfigError([linked_log_message(Path(self.baseFilename))]) from None
        return open(fd, "w" if "w" in self.mode else "a", encoding=self.encoding, errors=self.errors)


def linked_log_message(path: Path) -> str:
    from runner.files import linked_message

    return linked_message(path, os.readlink(path), "a log")
