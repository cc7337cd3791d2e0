"""MLflow's tracking store for logger=mlflow: where it is (a setting, MLFLOW_TRACKING_URI, or SQLite beside the run
folders), whether it answers, its experiment by name and a saved run; made one process at a time."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

DEFAULT_SOURCE = "the default: beside the run folders"


def tracking_uri_of(setting: Optional[str], store_dir: Path) -> tuple[str, str]:
    """The tracking URI and where it came from: the setting, MLFLOW_TRACKING_URI, else SQLite beside the runs."""
    if setting:
        return str(setting), "logger.mlflow.tracking_uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI"
    return f"sqlite:///{store_dir / 'mlflow.db'}", DEFAULT_SOURCE


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a `sqlite:///` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?")[0]
    return None if path in ("", ":memory:") else Path(path)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Creating a SQLite store (its schema, then the experiment) one process at a time.

    Parallel sweep jobs (the joblib launcher) that open one fresh database at once would each run its schema
    migrations and fail on the other's tables; under this lock the first creates it and the others find it.
    """
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def probe(uri: str) -> int:
    """The HTTP status of one search of the server's experiments: no retries, ten seconds at most."""
    from mlflow.utils.rest_utils import http_request

    try:
        from mlflow.utils.credentials import get_default_host_creds
    except ImportError:  # MLflow 2
        from mlflow.tracking._tracking_service.utils import get_default_host_creds
    response = http_request(get_default_host_creds(uri), "/api/2.0/mlflow/experiments/search", "GET",
                            max_retries=0, timeout=10, raise_on_status=False, params={"max_results": 1})
    return response.status_code


def open_database_store(uri: str, where: str) -> list[str]:
    """A database store (SQLite, PostgreSQL, ...) opened once, as the first log will: made if new, under the lock."""
    from mlflow.tracking import MlflowClient

    try:
        with store_lock(uri):
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as error:  # noqa: BLE001 - any failure to open the store is the message
        return [f"MLflow cannot use the store {where}: {type(error).__name__}: {' '.join(str(error).split())[:300]}"]
    return []


def open_file_store(uri: str, where: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as error:  # noqa: BLE001 - MLflow's refusal is the message
        return [f"MLflow cannot use the store {where}: {' '.join(str(error).split())[:300]} (the default, a "
                "SQLite database beside the run folders, needs no setting)"]
    return []


def experiment_id(client: Any, name: str, artifact_location: Optional[str]) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            raise ValueError(f"the MLflow experiment {name!r} is deleted: restore it (mlflow experiments restore "
                             f"--experiment-id {experiment.experiment_id}) or choose logger.mlflow.experiment_name")
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:  # another job of the sweep created it first (a server's store has no lock here)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def active_run(client: Any, saved: Mapping[str, Any]) -> Any:
    """The saved run, when the store still has it and it is not deleted."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(str(saved.get("run_id")))
    except MlflowException:
        return None
    return run if run.info.lifecycle_stage == "active" else None
