"""`logger=mlflow`: one MLflow run per job, in the tracking store the user keeps (a server, or SQLite by default).

The run starts with the first thing to log, not in the constructor: the checks before any worker starts build
the logger once in a scratch folder, and that must not leave a run behind. The run's id is kept in the run folder
(`mlflow_run.json`), so a resumed, restarted or requeued job continues the same MLflow run.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import urlparse

from runner.loggers import mlflow_store as store
from runner.loggers.base import NoExperiment, flat_params
from runner.loggers.media import histogram, hwc_array
from runner.loggers.tracking import cut, flatten, read_job, read_saved_run, read_settings, save_run

log = logging.getLogger("runner")
RUN_RECORD = "mlflow_run.json"
CHECKPOINT_CHOICES = ("best", "last", "all")
_HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml", "resolved.yaml")
INSTALL = "logger=mlflow needs the mlflow package: pip install 'runner[mlflow]' (or pip install mlflow)"


# MLflow's own defaults (120 s a request, 7 retries with back-off) hold one log call for about 20 minutes on a
# server that hangs: longer than strategy.stall_timeout, so a DDP job would be ended for it. A user's own settings
# of these variables win.
_REQUEST_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "20", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}


def _import_mlflow() -> None:
    try:
        import mlflow.tracking  # noqa: F401 - the client, imported only when this logger is chosen
    except ImportError as error:
        raise ImportError(f"{INSTALL} ({error})") from error


class MLflowLogger:
    """Metrics at their steps, the flattened resolved config as params, `.hydra/` and metrics.json as artifacts."""

    def __init__(self, root_dir: str, tracking_uri: Optional[str] = None, experiment_name: Optional[str] = None,
                 run_name: Optional[str] = None, tags: Optional[Mapping[str, Any]] = None,
                 log_checkpoints: Optional[str] = None, fail_on_error: bool = True) -> None:
        if log_checkpoints not in (None, False, *CHECKPOINT_CHOICES):
            raise ValueError(f"log_checkpoints={log_checkpoints} is not allowed: use best, last, all or null (off)")
        if tags is not None and not isinstance(tags, Mapping):
            raise ValueError(f"tags={tags} must map names to values, e.g. {{team: vision}}")
        if not isinstance(fail_on_error, bool):
            raise ValueError(f"fail_on_error={fail_on_error} must be true or false")
        _import_mlflow()
        for name, value in _REQUEST_LIMITS.items():  # read by MLflow's client at each request
            os.environ.setdefault(name, value)
        self.root = Path(root_dir)
        self.job = read_job(root_dir)
        self.tracking_uri, self._uri_source = store.tracking_uri_of(tracking_uri, self.job.store_dir)
        self.experiment_name = experiment_name or self.job.name
        self.run_name = run_name or self.job.run_name
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.log_checkpoints = log_checkpoints or None
        self.fail_on_error = fail_on_error
        self._run_id: Optional[str] = None
        self._experiment_id: Optional[str] = None
        self._client: Any = None
        self._params: dict[str, str] = {}  # what the run holds already
        self._logged: set[str] = set()
        self._last_step = 0
        self._failed = False

    # -- the checks before any worker starts ----------------------------------------------------------
    def check_service(self) -> list[str]:
        """One line per problem with the tracking store, found before training (a server that is down)."""
        where = f"{self.tracking_uri} (from {self._uri_source})"
        if self.tracking_uri.startswith("sqlite:") and store.sqlite_path(self.tracking_uri) is None:
            return [f"MLflow cannot keep runs in {where}: an in-memory database is lost when the process ends; "
                    "name a file (sqlite:////path/to/mlflow.db) or leave the setting out for the default"]
        folder = store.sqlite_path(self.tracking_uri)
        folder = folder.parent if folder is not None else None
        if folder is not None and self._uri_source != store.DEFAULT_SOURCE and not folder.is_dir():
            # The default's folder is the runs' own, made with them; a named one is never made up (a typo would
            # become a fresh database in a new folder, or a tree under / when run as root).
            what = "is not a folder;" if folder.exists() else f"does not exist; create it (mkdir -p {folder}) or"
            return [f"{self._uri_source}={self.tracking_uri}: {folder} {what} name a database in an existing "
                    "folder (or leave the setting out: the default keeps mlflow.db beside the run folders)"]
        if not self.tracking_uri.startswith(("http://", "https://", "file:")) and "://" in self.tracking_uri:
            return store.open_database_store(self.tracking_uri, where)
        if urlparse(self.tracking_uri).scheme in ("", "file"):  # recent MLflow refuses its plain file store
            return store.open_file_store(self.tracking_uri, where)
        try:
            status = store.probe(self.tracking_uri)
        except Exception as error:  # noqa: BLE001 - any failure to connect is the message
            text = " ".join(str(error).split())
            reason = (re.search(r"\[Errno -?\d+\][^'\")]*", text) or re.match(r".{0,200}", text)).group(0)
            return [f"no MLflow tracking server answers at {where}: {reason}; start it (mlflow server ...) or set "
                    "logger.mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to one that runs"]
        if status in (401, 403):
            return [f"the MLflow server at {where} refuses this user (HTTP {status}): set MLFLOW_TRACKING_USERNAME "
                    "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"]
        if status != 200:
            return [f"{where} answers HTTP {status} to MLflow's API: is it an MLflow tracking server?"]
        return []

    # -- Lightning's names: the run, its client, its folders (the run starts when first asked) ---------
    @property
    def experiment(self) -> Any:
        """MLflow's MlflowClient (with `run_id`: `self.logger.experiment.log_artifact(self.logger.run_id, path)`);
        one that does nothing where MLflow failed under fail_on_error=false."""
        self._guard(lambda: None)
        return self._client if self._client is not None else NoExperiment()

    @property
    def run_id(self) -> Optional[str]:
        self._guard(lambda: None)
        return self._run_id

    @property
    def experiment_id(self) -> Optional[str]:
        self._guard(lambda: None)
        return self._experiment_id

    @property
    def name(self) -> Optional[str]:
        """The experiment's id, as Lightning's MLFlowLogger names it."""
        return self.experiment_id

    @property
    def version(self) -> Optional[str]:
        return self.run_id

    @property
    def save_dir(self) -> Optional[str]:
        """The store's folder where it is one on this machine (a SQLite database's, a file store), else None."""
        path = store.sqlite_path(self.tracking_uri)
        if path is not None:
            return str(path.parent)
        return urlparse(self.tracking_uri).path if self.tracking_uri.startswith("file:") else None

    log_dir = save_dir

    # -- the logger's four methods --------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self._guard(self._log_metrics, metrics, self._last_step if step is None else int(step))

    def resume_at(self, step: int) -> None:
        log.info("MLflow keeps every logged value: the steps from %d on are logged again, and a step's latest "
                 "value (by timestamp) is this run's", step)

    def log_hyperparams(self, params: Any, metrics: Optional[Mapping[str, float]] = None) -> None:
        """At the end, the run's settings and final metrics; the user's own calls (without `metrics`) log their
        params at once."""
        if metrics is None:
            self._guard(self._log_params, flat_params(params))
            return
        self._guard(self._log_end, params, metrics)

    # -- media: images as MLflow's image series, the others as artifacts under <name>/ ------------------
    def log_image(self, name: str, image: Any, step: int, dataformats: str = "CHW") -> None:
        self._guard(lambda: self._client.log_image(self._run_id, hwc_array(image, dataformats), key=_param_key(name),
                                                   step=step))

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        counts, edges = histogram(values)
        self._guard(lambda: self._client.log_dict(self._run_id, {"counts": counts, "edges": edges},
                                                  f"{_param_key(name)}/step-{step:06d}.json"))

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        self._guard(lambda: self._client.log_figure(self._run_id, figure, f"{_param_key(name)}/step-{step:06d}.png"))

    def log_text(self, name: str, text: str, step: int) -> None:
        self._guard(lambda: self._client.log_text(self._run_id, text, f"{_param_key(name)}/step-{step:06d}.txt"))

    def finalize(self) -> None:
        failed = sys.exc_info()[0] is not None  # called from a `finally`: an exception is on its way out
        if self._client is None and not (self.root / ".hydra" / "resolved.yaml").is_file():
            return  # nothing was logged, and this is no job's folder (the checks' scratch build)
        if not failed:
            self._guard(self._finish, "FINISHED")
            return
        try:  # the job's own error is the one to report, not the store's
            self._guard(self._finish, "FAILED")
        except RuntimeError as error:
            log.warning("%s", error)

    # -- the run ----------------------------------------------------------------------------------------
    def _guard(self, action: Any, *args: Any) -> None:
        """Run `action`; a failing store ends the job, or with fail_on_error=false is one warning and no more."""
        if self._failed:
            return
        try:
            if self._client is None:
                self._start()
            action(*args)
        except Exception as error:
            if self.fail_on_error:
                raise RuntimeError(f"MLflow at {self.tracking_uri}: {' '.join(str(error).split())[:500]}") from error
            self._failed = True
            log.warning("MLflow at %s failed (%s); training goes on without it (logger.mlflow.fail_on_error=false), "
                        "and the run folder keeps every metric", self.tracking_uri, " ".join(str(error).split())[:300])

    def _start(self) -> None:
        from mlflow.tracking import MlflowClient

        with store.store_lock(self.tracking_uri):  # the client opens (and may create) the store when it is made
            client = MlflowClient(tracking_uri=self.tracking_uri)
            experiment_id = store.experiment_id(client, self.experiment_name, self._artifact_location())
        run = self._saved_run(client, experiment_id)
        if run is not None:
            client.update_run(run.info.run_id, status="RUNNING")
            log.info("continuing MLflow run %s (experiment %s) at %s", run.info.run_id, run.info.experiment_id,
                     self.tracking_uri)
        else:
            run = client.create_run(experiment_id, run_name=self.run_name, tags=self._run_tags())
            save_run(self.root / RUN_RECORD, {"tracking_uri": self.tracking_uri, "experiment_id": experiment_id,
                                              "run_id": run.info.run_id})
            log.info("MLflow run %s in experiment %s at %s", run.info.run_id, self.experiment_name, self.tracking_uri)
        self._client, self._run_id, self._experiment_id = client, run.info.run_id, experiment_id
        self._params = dict(run.data.params)
        self._log_params(flatten(read_settings(str(self.root))))

    def _saved_run(self, client: Any, experiment_id: str) -> Any:
        """The MLflow run this folder's record names, when it is this folder's run of the experiment; a record that
        cannot be continued (damaged, another store's, a run the store lost, another folder's) is one warning."""
        record = self.root / RUN_RECORD
        if not record.exists():
            return None
        saved = read_saved_run(record)
        run = store.active_run(client, saved) if saved.get("tracking_uri") == self.tracking_uri else None
        if not saved.get("run_id") or not saved.get("tracking_uri"):
            why = "is damaged (not a JSON record with tracking_uri and run_id)"
        elif saved["tracking_uri"] != self.tracking_uri:
            why = f"names a run of another store ({saved['tracking_uri']})"
        elif run is None:
            why = f"names MLflow run {saved['run_id']}, which {self.tracking_uri} does not hold (or holds deleted)"
        elif (run.info.experiment_id != experiment_id
              or run.data.tags.get("runner.run_dir") != str(self.job.run_dir)):
            why = (f"names MLflow run {run.info.run_id}, which is not this folder's run of experiment "
                   f"{self.experiment_name} (a copied or edited folder?)")
        else:
            return run
        log.warning("%s %s: starting a new run", record, why)
        return None

    def _artifact_location(self) -> Optional[str]:
        """Beside a SQLite database, its artifacts (MLflow's own default is ./mlruns, wherever the run starts)."""
        path = store.sqlite_path(self.tracking_uri)
        return (path.parent / "mlartifacts").resolve().as_uri() if path is not None else None

    def _run_tags(self) -> dict[str, str]:
        tags = {"runner.run_dir": str(self.job.run_dir), "runner.stage": self.job.stage}
        if self.job.sweep_dir is not None:
            tags["runner.sweep_dir"] = str(self.job.sweep_dir)
            tags["runner.job_num"] = "" if self.job.number is None else str(self.job.number)
        return {**tags, **self.tags}

    def _log_params(self, params: Mapping[str, Any]) -> None:
        """New params only: MLflow refuses to change a run's param, so a resumed run keeps its first values."""
        from mlflow.entities import Param
        from mlflow.utils import validation

        value_limit = getattr(validation, "MAX_PARAM_VAL_LENGTH", 500)
        key_limit = getattr(validation, "MAX_ENTITY_KEY_LENGTH", 250)
        batch = getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
        values = {cut(_param_key(k), key_limit): cut(str(v), value_limit) for k, v in params.items()}
        changed = sorted(k for k, v in values.items() if k in self._params and self._params[k] != v)
        if changed:
            log.warning("MLflow run %s keeps the params it started with; this attempt differs in %s", self._run_id,
                        ", ".join(f"{k} ({self._params[k]} -> {values[k]})" for k in changed[:5]))
        new = [Param(k, v) for k, v in values.items() if k not in self._params]
        for start in range(0, len(new), batch):
            self._client.log_batch(self._run_id, params=new[start:start + batch])
        self._params.update((p.key, p.value) for p in new)

    def _log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = [Metric(name, float(value), stamp, step) for name, value in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow's largest batch of metrics
            self._client.log_batch(self._run_id, metrics=batch[start:start + 1000])
        self._logged.update(metrics)
        self._last_step = max(self._last_step, step)

    def _log_end(self, params: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        """The final metrics that no step logged join the last step (as in TensorBoard and metrics.csv)."""
        self._log_params(params)
        unlogged = {name: value for name, value in metrics.items() if name not in self._logged}
        if unlogged:
            self._log_metrics(unlogged, self._last_step)

    def _finish(self, status: str) -> None:
        hydra = self.root / ".hydra"
        for name in _HYDRA_FILES:
            if (hydra / name).is_file():
                self._client.log_artifact(self._run_id, str(hydra / name), ".hydra")
        if (self.root / "metrics.json").is_file():
            self._client.log_artifact(self._run_id, str(self.root / "metrics.json"))
        for path in self._checkpoints():
            self._client.log_artifact(self._run_id, str(path), "checkpoints")
        self._client.set_terminated(self._run_id, status=status)

    def _checkpoints(self) -> list[Path]:
        folder = self.root / "checkpoints"
        if self.log_checkpoints == "all":
            return sorted(p for p in folder.glob("*") if p.is_file() and ".tmp-" not in p.name)
        if self.log_checkpoints in ("best", "last"):
            return sorted(folder.glob(f"{self.log_checkpoints}.ckpt*"))  # the file and what is written with it
        return []


def _param_key(key: str) -> str:
    """MLflow's key characters: letters, digits, `_ - . / ` and spaces; any other becomes `_`."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)
