"""logger=mlflow and logger=wandb with the real services: an MLflow server on loopback (and MLflow's SQLite store),
W&B offline, read back with their own clients and file formats and compared with metrics.csv and metrics.json."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from _dist import assert_ok, clean_environ, free_port, run_cli

pytestmark = pytest.mark.xdist_group("tracking")

TINY = ["accelerator=cpu", "trainer.max_epochs=-1", "trainer.log_every_n_steps=1", "data.num_samples=64",
        "data.val_samples=16", "data.batch_size=8", "data.num_features=8", "model.hidden=16"]
SINGLE = ["strategy=single", "cluster=local", "trainer.devices=1"]


def cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m runner` in `cwd`, where an ./mlruns or ./wandb left behind would show."""
    flags = [a for a in args if a.startswith("-")]  # -m before the overrides
    return run_cli([*flags, *TINY, *(a for a in args if a not in flags)], cwd=cwd, env=clean_environ(**env),
                   timeout=300)


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def csv_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv as {metric: [(step, value), ...]}: the rows where the metric has a value."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name != "step" and value != "":
                    series.setdefault(name, []).append((int(row["step"]), float(value)))
    return series


def mlflow_series(client: Any, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric's history, one value per step: the latest logged (a resumed run logs its steps again)."""
    series = {}
    for name in client.get_run(run_id).data.metrics:
        latest: dict[int, Any] = {}
        for metric in sorted(client.get_metric_history(run_id, name), key=lambda m: m.timestamp):
            latest[metric.step] = metric.value
        series[name] = sorted(latest.items())
    return series


def run_id_of(run_dir: Path) -> str:
    return json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]


# -- an MLflow server for the module ------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 with a SQLite store in a temporary folder; its process group ends with the
    module, whatever the tests did."""
    pytest.importorskip("mlflow.server")
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = open(folder / "server.log", "w")  # noqa: SIM115 - closed at teardown
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'store.db'}", "--artifacts-destination", str(folder / "art")],
        env=clean_environ(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True, cwd=folder)
    try:
        deadline = time.monotonic() + 180
        while not _answers(f"{uri}/health"):
            assert server.poll() is None, (folder / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer within 180 s"
            time.sleep(0.5)
        yield uri
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(server.pid, sig)
                server.wait(timeout=20)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# -- MLflow -------------------------------------------------------------------------------------------

def test_ddp_run_logs_params_metrics_and_artifacts_to_a_server(tmp_path: Path, mlflow_server: str) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    result = cli(["strategy=ddp", "trainer.devices=2", "trainer.max_steps=4", "logger=[csv,mlflow]",
                  f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=ddp",
                  "logger.mlflow.log_checkpoints=last", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert_ok(result)
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("ddp")
    (run,) = client.search_runs([experiment.experiment_id])  # rank 1 made none
    assert run.info.run_id == run_id_of(run_dir)
    assert run.info.status == "FINISHED"
    assert run.data.tags["runner.run_dir"] == str(run_dir.resolve())
    resolved = yaml.safe_load((run_dir / ".hydra" / "resolved.yaml").read_text())
    where = json.loads((run_dir / "metrics.json").read_text())["run"]  # what ran where, logged with the settings
    assert run.data.params == {**{key: str(value) for key, value in flat(resolved).items()},
                               **{f"run/{key}": str(value) for key, value in where.items()}}
    assert run.data.params["strategy._target_"] == "runner.strategies.DDPStrategy"
    assert mlflow_series(client, run.info.run_id) == csv_series(run_dir)
    assert all(len(client.get_metric_history(run.info.run_id, name)) == len(values)  # each step once
               for name, values in csv_series(run_dir).items())
    hydra = {a.path for a in client.list_artifacts(run.info.run_id, ".hydra")}
    assert hydra == {f".hydra/{name}" for name in ("config.yaml", "hydra.yaml", "overrides.yaml", "resolved.yaml")}
    downloaded = Path(client.download_artifacts(run.info.run_id, "metrics.json", str(tmp_path)))
    assert downloaded.read_bytes() == (run_dir / "metrics.json").read_bytes()
    checkpoints = Path(client.download_artifacts(run.info.run_id, "checkpoints/last.ckpt", str(tmp_path)))
    assert checkpoints.read_bytes() == (run_dir / "checkpoints" / "last.ckpt").read_bytes()
    assert not (tmp_path / "mlruns").exists()


def test_long_params_are_cut_with_a_marker(tmp_path: Path, mlflow_server: str) -> None:
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    from runner.loggers.mlflow import MLflowLogger
    from runner.loggers.tracking import CUT_MARKER

    (tmp_path / ".hydra").mkdir()
    long = "x" * (MAX_PARAM_VAL_LENGTH + 100)
    (tmp_path / ".hydra" / "resolved.yaml").write_text(yaml.safe_dump({"data": {"files": long}, "stage": "fit"}))
    logger = MLflowLogger(str(tmp_path), tracking_uri=mlflow_server, experiment_name="cut")
    logger.log_metrics({"train/loss": 0.5}, 1)
    logger.log_hyperparams({"data.files": long, "stage": "fit", "model.note": "y" * 7000}, {"train/loss": 0.5})
    logger.finalize()
    params = MlflowClient(tracking_uri=mlflow_server).get_run(logger.run_id).data.params
    assert params["data.files"] == long[:MAX_PARAM_VAL_LENGTH - len(CUT_MARKER)] + CUT_MARKER
    assert len(params["model.note"]) == MAX_PARAM_VAL_LENGTH and params["model.note"].endswith(CUT_MARKER)


def test_a_resumed_attempt_continues_the_run_and_its_values_are_the_latest(tmp_path: Path, mlflow_server: str) -> None:
    from mlflow.tracking import MlflowClient

    from runner.loggers.mlflow import MLflowLogger

    first = MLflowLogger(str(tmp_path), tracking_uri=mlflow_server, experiment_name="resume")
    for step in (1, 2, 3):  # killed after step 3; its checkpoint was at step 1
        first.log_metrics({"train/loss": 1.0 / step}, step)
    second = MLflowLogger(str(tmp_path), tracking_uri=mlflow_server, experiment_name="resume")
    second.resume_at(2)
    time.sleep(0.01)  # MLflow orders a step's values by their millisecond timestamps
    for step in (2, 3, 4):
        second.log_metrics({"train/loss": 10.0 + step}, step)
    second.finalize()
    assert second.run_id == first.run_id
    client = MlflowClient(tracking_uri=mlflow_server)
    assert mlflow_series(client, first.run_id)["train/loss"] == [(1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]
    assert client.get_run(first.run_id).data.metrics["train/loss"] == 14.0


def test_a_server_that_goes_down_is_one_warning_with_fail_on_error_false(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("mlflow")
    from runner.loggers.mlflow import MLflowLogger

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down = f"http://127.0.0.1:{free_port()}"
    logger = MLflowLogger(str(tmp_path), tracking_uri=down, fail_on_error=False)
    with caplog.at_level("WARNING", logger="runner"):
        for step in (1, 2, 3):
            logger.log_metrics({"train/loss": 1.0}, step)
        logger.finalize()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and down in warnings[0] and "fail_on_error=false" in warnings[0]
    strict = MLflowLogger(str(tmp_path), tracking_uri=down)
    with pytest.raises(RuntimeError, match=down.replace(".", r"\.")):
        strict.log_metrics({"train/loss": 1.0}, 1)


def test_a_server_that_is_not_running_is_one_line_before_any_worker(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    down = f"http://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    result = cli(["strategy=ddp", "trainer.devices=2", "trainer.max_steps=2", "logger=mlflow",
                  f"logger.mlflow.tracking_uri={down}", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if down in line]
    assert len(lines) == 1 and "logger.mlflow" in lines[0] and "no MLflow tracking server answers" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (run_dir / "rank_1.log").exists() and not (run_dir / "checkpoints").exists()


def test_default_store_is_sqlite_beside_the_runs_and_a_resume_continues_the_run(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    outputs, work = tmp_path / "outputs", tmp_path / "work"
    work.mkdir()
    run_dir = outputs / "2026-01-31" / "12-00-00"
    common = [*SINGLE, "logger=[csv,mlflow]", f"hydra.run.dir={run_dir}"]
    assert_ok(cli([*common, "trainer.max_steps=3"], cwd=work))
    client = MlflowClient(tracking_uri=f"sqlite:///{outputs / 'mlflow.db'}")
    run_id = run_id_of(run_dir)
    assert client.get_run(run_id).info.run_name == "2026-01-31/12-00-00"
    assert Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://")).is_relative_to(outputs)
    assert not (work / "mlruns").exists() and not (work / "mlflow.db").exists()

    resumed = cli([*common, "trainer.max_steps=5", "trainer.ckpt_path=last"], cwd=work)
    assert_ok(resumed)
    assert run_id_of(run_dir) == run_id
    experiment = client.get_experiment_by_name("runner")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    series = mlflow_series(client, run_id)
    assert series == csv_series(run_dir)
    assert series["train/loss"][-1][0] == 5
    assert client.get_run(run_id).info.status == "FINISHED"


def _sweep_runs(client: Any, sweep_dir: Path) -> dict[str, Any]:
    experiment = client.get_experiment_by_name("runner")
    runs = client.search_runs([experiment.experiment_id])
    assert {r.data.tags["runner.sweep_dir"] for r in runs} == {str(sweep_dir.resolve())}
    return {r.data.tags["runner.job_num"]: r for r in runs}


def test_sweep_jobs_are_runs_of_one_experiment_and_one_wandb_group(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    sweep_dir = tmp_path / "multirun" / "2026-01-31" / "12-00-00"
    result = cli(["-m", *SINGLE, "trainer.max_steps=2", "optimizer.lr=0.1,0.01", "logger=[csv,mlflow,wandb]",
                  f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, WANDB_MODE="offline")
    assert_ok(result)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'multirun' / 'mlflow.db'}")
    runs = _sweep_runs(client, sweep_dir)
    assert sorted(runs) == ["0", "1"]
    for number, run in runs.items():
        assert run.info.run_id == run_id_of(sweep_dir / number)
        assert run.data.params["optimizer.lr"] == ("0.1" if number == "0" else "0.01")
        assert mlflow_series(client, run.info.run_id) == csv_series(sweep_dir / number)
    for number in ("0", "1"):  # both jobs ran in this one process: each finished its own W&B run
        (record,) = wandb_records(sweep_dir / number)
        assert record["run"].run_group == "2026-01-31/12-00-00" and record["run"].job_type == "fit"
        assert record["exit"] is not None


def test_parallel_sweep_jobs_create_one_fresh_database_without_racing(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    from mlflow.tracking import MlflowClient

    sweep_dir = tmp_path / "multirun" / "s"
    result = cli(["-m", *SINGLE, "trainer.max_steps=2", "optimizer.lr=0.1,0.01", "logger=[csv,mlflow]",
                  "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path)
    assert_ok(result)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'multirun' / 'mlflow.db'}")
    runs = _sweep_runs(client, sweep_dir)
    assert sorted(runs) == ["0", "1"]
    for number, run in runs.items():
        assert mlflow_series(client, run.info.run_id) == csv_series(sweep_dir / number)


# -- W&B ----------------------------------------------------------------------------------------------

def read_wandb(path: Path) -> Iterator[Any]:
    """The records of an offline run's .wandb file: W&B's LevelDB-style log (32 KiB blocks; each chunk has a
    CRC-32, a length and a type: full, first, middle, last) of `wandb_internal_pb2.Record` messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    index, parts = 7, b""
    while index + 7 <= len(data):
        if 32768 - index % 32768 < 7:  # a block's tail too short for a header is padding
            index += 32768 - index % 32768
            continue
        checksum, length, kind = struct.unpack("<IHB", data[index:index + 7])
        if kind == 0:
            break
        chunk = data[index + 7:index + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum
        index, parts = index + 7 + length, parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """Each offline run in the run folder: its run record, config, history rows, summary and exit record."""
    found = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run, config, history, summary, end = None, {}, [], {}, None
        for record in read_wandb(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
            elif kind == "summary":
                summary.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.summary.update})
            elif kind == "exit":
                end = record.exit
        found.append({"run": run, "config": config, "history": history, "summary": summary, "exit": end})
    return found


@pytest.fixture
def listener() -> Iterator[tuple[str, socket.socket]]:
    """A loopback socket W&B is pointed at instead of its service: any connection to it is a leak."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield f"http://127.0.0.1:{server.getsockname()[1]}", server
    server.close()


def _connections(server: socket.socket) -> int:
    count = 0
    while True:
        try:
            server.accept()[0].close()
        except BlockingIOError:
            return count
        count += 1


def test_wandb_offline_run_in_the_run_folder_and_a_resume_starts_a_new_run(
        tmp_path: Path, listener: tuple[str, socket.socket]) -> None:
    pytest.importorskip("wandb")
    url, server = listener
    env = {"WANDB_BASE_URL": url}  # no WANDB_MODE: offline is the logger's own default
    run_dir = tmp_path / "outputs" / "2026-01-31" / "12-00-00"
    common = [*SINGLE, "logger=[csv,wandb]", f"hydra.run.dir={run_dir}"]
    assert_ok(cli([*common, "trainer.max_steps=3"], cwd=tmp_path, **env))
    (first,) = wandb_records(run_dir)
    resolved = yaml.safe_load((run_dir / ".hydra" / "resolved.yaml").read_text())
    assert {k: v for k, v in first["config"].items() if k != "_wandb"} == resolved
    assert first["run"].run_group == "2026-01-31/12-00-00" and first["run"].job_type == "fit"
    final = {k: v for k, v in json.loads((run_dir / "metrics.json").read_text()).items() if isinstance(v, float)}
    assert {k: first["summary"][k] for k in final} == pytest.approx(final)
    rows = [(row["_step"], {k: v for k, v in row.items() if not k.startswith("_")}) for row in first["history"]]
    from_csv: dict[int, dict[str, float]] = {}
    for name, values in csv_series(run_dir).items():
        for step, value in values:
            from_csv.setdefault(step, {})[name] = value
    assert [step for step, _ in rows] == sorted(from_csv)
    assert all(values == pytest.approx(from_csv[step]) for step, values in rows)
    assert not (tmp_path / "wandb").exists()

    resumed = cli([*common, "trainer.max_steps=5", "trainer.ckpt_path=last"], cwd=tmp_path, **env)
    assert_ok(resumed)
    runs = wandb_records(run_dir)
    assert len(runs) == 2
    second = next(r for r in runs if r["run"].run_id != first["run"].run_id)
    assert second["run"].run_group == first["run"].run_group
    assert "cannot resume offline run" in (run_dir / "runner.log").read_text()
    assert min(row["_step"] for row in second["history"]) == 4
    assert _connections(server) == 0


def test_the_command_line_help_imports_neither_client(tmp_path: Path) -> None:
    code = ("import sys; sys.argv = ['runner', '--help']\nimport runner.cli\ntry:\n    runner.cli.main()\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=clean_environ(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_bad_settings_are_one_line_each_before_any_worker(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    result = cli([*SINGLE, "trainer.max_steps=2", "logger=[mlflow,wandb]", "logger.mlflow.log_checkpoints=every",
                  "logger.wandb.mode=sometimes", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 1
    assert "log_checkpoints=every is not allowed: use best, last, all or null" in result.stderr
    assert "mode=sometimes is not allowed: use offline (the default), online or disabled" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_plain_file_store_is_one_line_not_a_silent_mlruns(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    result = cli([*SINGLE, "trainer.max_steps=2", "logger=mlflow", "logger.mlflow.tracking_uri=./mlruns",
                  f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 1
    (line,) = [line for line in result.stderr.splitlines() if "./mlruns" in line]
    assert line.startswith("  - logger.mlflow: MLflow cannot use the store ./mlruns (from logger.mlflow.tracking_uri)")
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "run" / "checkpoints").exists()


# -- Lightning's logger surface, and media, on the trackers ---------------------------------------------------------

def _media(logger: Any, step: int) -> None:
    """An image, a histogram, a figure and a text at `step`, as runner.loggers' functions hand them to a logger."""
    import matplotlib
    import torch

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure()
    plt.plot([0, 1], [1, 0])
    logger.log_image("val/sample", torch.rand(3, 8, 8), step)
    logger.log_histogram("weights/first", torch.randn(100), step)
    logger.log_figure("val/curve", figure, step)
    logger.log_text("val/note", "seen", step)
    plt.close(figure)


def test_mlflow_gives_lightnings_client_and_run_id_and_takes_media(tmp_path: Path, mlflow_server: str) -> None:
    """self.logger.experiment is MLflow's MlflowClient and run_id the run's (Lightning's MLFlowLogger surface); the
    user's log_hyperparams logs its params at once, and the media go to the run: an image series, the others as
    artifacts under their names."""
    from mlflow.tracking import MlflowClient

    from runner.loggers.mlflow import MLflowLogger

    logger = MLflowLogger(str(tmp_path), tracking_uri=mlflow_server, experiment_name="surface")
    assert isinstance(logger.experiment, MlflowClient) and logger.version == logger.run_id == run_id_of(tmp_path)
    assert logger.save_dir is None and logger.name == logger.experiment_id  # a server: no folder here
    logger.experiment.log_text(logger.run_id, "mine", "notes/own.txt")
    logger.log_hyperparams({"user": {"depth": 2}})
    logger.log_metrics({"custom/metric": 1.5}, step=3)
    _media(logger, 3)
    logger.finalize()
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(logger.run_id)
    assert run.data.params["user.depth"] == "2" and run.data.metrics["custom/metric"] == 1.5
    artifacts = {a.path for folder in ("", "notes", "weights/first", "val/curve", "val/note", "images")
                 for a in client.list_artifacts(logger.run_id, folder or None)}
    assert {"notes/own.txt", "weights/first/step-000003.json", "val/curve/step-000003.png",
            "val/note/step-000003.txt"} <= artifacts
    assert any(path.startswith("images/val") for path in artifacts)  # the image series of key val/sample


def test_wandb_gives_lightnings_run_and_takes_media(tmp_path: Path, listener: tuple[str, socket.socket],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """self.logger.experiment is the W&B run (offline, in the run folder); the media are its history's images,
    histogram and html at the step; the user's log_hyperparams joins its config."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_BASE_URL", listener[0])
    from runner.loggers.wandb import WandbLogger

    logger = WandbLogger(str(tmp_path))
    assert logger.experiment.id == logger.version and logger.save_dir == str(tmp_path)
    logger.log_hyperparams({"user": {"depth": 2}})
    logger.log_metrics({"custom/metric": 1.5}, step=3)
    _media(logger, 3)
    logger.finalize()
    logger._wandb.teardown()  # W&B's service ends here (its writer finishes after finish()), not at the exit
    deadline = time.monotonic() + 30
    while not (runs := wandb_records(tmp_path)) or runs[0]["exit"] is None:
        assert time.monotonic() < deadline, "the offline run's file was not complete within 30 s"
        time.sleep(0.2)
    (run,) = runs
    assert run["config"]["user.depth"] == 2
    row = {k: v for history in run["history"] for k, v in history.items() if history.get("_step") == 3}
    assert row["custom/metric"] == 1.5
    assert [row[f"{name}/_type"] for name in ("val/sample", "weights/first", "val/curve", "val/note")] == [
        "image-file", "histogram", "image-file", "html-file"]
    assert _connections(listener[1]) == 0
