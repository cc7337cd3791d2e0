"""Loggers: TensorBoard's event files (the record format TensorBoard checks, flushing, HParams, resume), the CSV
logger's rows, several loggers at once, none, and a logger of the user's own."""

from __future__ import annotations

import csv
import os
import struct
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from conftest import TINY, compose_config
from runner.loggers import CSVLogger, TensorBoardLogger


def event_files(root: Path) -> list[Path]:
    return sorted((root / "tensorboard").glob("events.out.tfevents.*"))


def read_raw(path: Path) -> list[Event]:
    """The events of one file as written, through TensorBoard's reader (which checks every checksum)."""
    return [Event.FromString(record) for record in RawEventFileLoader(str(path)).Load()]


def scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the files under `path`, as TensorBoard's accumulator sees them (purges applied)."""
    events = EventAccumulator(str(path), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_records_carry_the_checksums_tensorboard_verifies(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path))
    for step in range(1, 4):
        logger.log_metrics({"train/loss": 1.0 / step, "lr": 0.1}, step)
    logger.finalize()
    (path,) = event_files(tmp_path)
    data, records = path.read_bytes(), 0
    while data:  # TFRecord: length, masked CRC-32C of the length, payload, masked CRC-32C of the payload
        (length,) = struct.unpack("<Q", data[:8])
        assert struct.unpack("<I", data[8:12])[0] == masked_crc32c(data[:8])
        payload = data[12:12 + length]
        assert struct.unpack("<I", data[12 + length:16 + length])[0] == masked_crc32c(payload)
        data, records = data[16 + length:], records + 1
    assert records == 4  # the file version, then one event per logged step
    events = read_raw(path)
    assert events[0].file_version == "brain.Event:2"
    assert [e.step for e in events[1:]] == [1, 2, 3]
    assert scalars(path)["train/loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1.0 / 3))]


def test_one_event_per_log_step_holds_all_its_scalars(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path))
    logger.log_metrics({"train/loss": 2.0, "train/acc": 0.25, "lr": 0.01}, 7)
    logger.finalize()
    (path,) = event_files(tmp_path)
    (event,) = [e for e in read_raw(path) if e.HasField("summary")]
    assert event.step == 7
    values = {v.tag: v.simple_value for v in event.summary.value}
    assert values == {"train/loss": 2.0, "train/acc": 0.25, "lr": pytest.approx(0.01)}


def test_events_reach_the_disk_within_flush_secs_while_the_run_goes_on(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path), flush_secs=0.05)
    logger.log_metrics({"train/loss": 1.5}, 1)  # and nothing after it: the flushing thread writes it out
    (path,) = event_files(tmp_path)
    deadline = time.monotonic() + 10
    while "train/loss" not in scalars(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scalars(path)["train/loss"] == [(1, 1.5)]  # readable before finalize()
    logger.finalize()
    buffered = TensorBoardLogger(str(tmp_path / "buffered"), flush_secs=3600)
    buffered.log_metrics({"train/loss": 1.5}, 1)
    (path,) = event_files(tmp_path / "buffered")
    assert "train/loss" not in scalars(path)
    buffered.finalize()
    assert scalars(path)["train/loss"] == [(1, 1.5)]


def test_hparams_hold_the_settings_and_final_metrics_in_the_same_file(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path))
    logger.log_metrics({"train/loss": 0.5}, 10)
    logger.log_hyperparams({"optimizer.lr": 0.1, "model.depth": 2, "tags": [1, 2]},
                           {"train/loss": 0.5, "val/loss": 0.7})
    logger.finalize()
    (path,) = event_files(tmp_path)
    events = EventAccumulator(str(path))
    events.Reload()
    assert {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"} <= set(
        events.PluginTagToContent("hparams"))
    # val/loss was never logged as a series: it is written once, at the last step, for HParams to read
    assert scalars(path) == {"train/loss": [(10, 0.5)], "val/loss": [(10, pytest.approx(0.7))]}


def test_a_resumed_run_hides_what_the_stopped_attempt_logged_after_its_checkpoint(tmp_path: Path) -> None:
    first = TensorBoardLogger(str(tmp_path))
    for step in (5, 10, 15, 20):  # the attempt stopped after step 20; its checkpoint is from step 10
        first.log_metrics({"train/loss": float(step)}, step)
    first.finalize()
    resumed = TensorBoardLogger(str(tmp_path))
    resumed.resume_at(11)
    for step in (15, 20):
        resumed.log_metrics({"train/loss": float(step) + 0.5}, step)
    resumed.finalize()
    assert len(event_files(tmp_path)) == 2
    new_file = event_files(tmp_path)[-1]
    start = [e for e in read_raw(new_file) if e.HasField("session_log")]
    assert [(e.step, e.session_log.status) for e in start] == [(11, 1)]  # SessionLog.START purges steps >= 11
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [(5, 5.0), (10, 10.0), (15, 15.5), (20, 20.5)]


def test_a_fresh_run_in_a_folder_that_has_events_replaces_them(tmp_path: Path) -> None:
    """A re-run in the same folder, or a restart before the first checkpoint: each step appears once."""
    first = TensorBoardLogger(str(tmp_path))
    for step in (1, 2, 3):
        first.log_metrics({"train/loss": float(step)}, step)
    first.finalize()
    again = TensorBoardLogger(str(tmp_path))  # not resumed: it starts at step 1 again
    for step in (1, 2):
        again.log_metrics({"train/loss": step + 0.5}, step)
    again.finalize()
    files = event_files(tmp_path)
    assert len(files) == 2 and files[-1].name.split(".")[3] > files[0].name.split(".")[3]  # read after the first
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 1.5), (2, 2.5)]


def test_a_logger_that_logs_nothing_writes_no_file(tmp_path: Path) -> None:
    TensorBoardLogger(str(tmp_path)).finalize()
    assert not (tmp_path / "tensorboard").exists()


# -- CSV ----------------------------------------------------------------------------------------------

def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_has_one_row_per_log_step_shared_by_training_and_validation(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path))
    logger.log_metrics({"train/loss": 2.0, "lr": 0.1}, 5)
    logger.log_metrics({"train/loss": 1.5, "lr": 0.1}, 10)
    logger.log_metrics({"val/loss": 1.25, "val/acc": 0.5}, 10)  # validation after the same step: its row
    logger.log_metrics({"train/loss": 1.0, "lr": 0.1}, 15)
    logger.log_hyperparams({"optimizer.lr": 0.1}, {"train/loss": 1.0, "val/loss": 1.25, "best": 0.75})
    logger.finalize()
    rows = csv_rows(tmp_path / "metrics.csv")
    assert list(rows[0]) == ["step", "train/loss", "lr", "val/loss", "val/acc", "best"]
    assert [r["step"] for r in rows] == ["5", "10", "15"]
    assert rows[1] == {"step": "10", "train/loss": "1.5", "lr": "0.1", "val/loss": "1.25", "val/acc": "0.5", "best": ""}
    assert rows[0]["val/loss"] == "" and rows[2]["best"] == "0.75"  # a final metric no row held: the last row


def test_csv_rows_are_appended_whole_with_one_write_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[bytes] = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    logger = CSVLogger(str(tmp_path))
    for step in range(1, 6):
        logger.log_metrics({"train/loss": 1.0 / step}, step)
        if step > 1:  # the previous step's row is on disk, complete, while this one is being logged
            text = (tmp_path / "metrics.csv").read_text()
            assert text.endswith("\n") and [r["step"] for r in csv_rows(tmp_path / "metrics.csv")] == [
                str(s) for s in range(1, step)]
    logger.finalize()
    assert len(writes) == 4 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)  # step 1: rewrite


def test_csv_resume_drops_the_rows_at_or_after_the_resume_step(tmp_path: Path) -> None:
    first = CSVLogger(str(tmp_path))
    for step in (5, 10, 15, 20):  # the attempt stopped after step 20; its checkpoint is from step 10
        first.log_metrics({"train/loss": float(step)}, step)
    first.log_metrics({"val/loss": 9.0}, 20)
    first.finalize()
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("2")  # and a killed process left half a line
    resumed = CSVLogger(str(tmp_path))
    resumed.resume_at(11)
    for step in (15, 20, 25):
        resumed.log_metrics({"train/loss": step + 0.5}, step)
    resumed.finalize()
    rows = csv_rows(tmp_path / "metrics.csv")
    assert [(r["step"], r["train/loss"]) for r in rows] == [("5", "5.0"), ("10", "10.0"), ("15", "15.5"),
                                                            ("20", "20.5"), ("25", "25.5")]
    assert all(r["val/loss"] == "" for r in rows)  # the stopped attempt's step-20 validation is gone too


def test_csv_a_new_run_replaces_an_old_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("step,train/loss\n1,9.0\n2,8.0\n")
    logger = CSVLogger(str(tmp_path))
    logger.log_metrics({"train/loss": 1.0}, 1)
    logger.finalize()
    assert csv_rows(tmp_path / "metrics.csv") == [{"step": "1", "train/loss": "1.0"}]


def test_csv_logger_that_logs_nothing_writes_no_file(tmp_path: Path) -> None:
    CSVLogger(str(tmp_path)).finalize()
    assert not list(tmp_path.iterdir())


# -- loggers of a run ---------------------------------------------------------------------------------

class RecordingLogger:
    """A logger of the user's own: any class with the four methods."""

    calls: list[tuple] = []

    def __init__(self, root_dir: str, tag: str = "") -> None:
        RecordingLogger.calls.append(("init", Path(root_dir).name, tag))

    def log_metrics(self, metrics, step):
        RecordingLogger.calls.append(("log_metrics", step, sorted(metrics)))

    def resume_at(self, step):
        RecordingLogger.calls.append(("resume_at", step))

    def log_hyperparams(self, params, metrics):
        RecordingLogger.calls.append(("log_hyperparams", "optimizer.lr" in params))

    def finalize(self):
        RecordingLogger.calls.append(("finalize",))


def fit(run_dir: Path, *overrides: str) -> dict:
    """A tiny run in-process with the loggers chosen by `overrides` (TINY's TensorBoard setting left out)."""
    import runner

    tiny = [o for o in TINY if not o.startswith("logger.")]
    return runner.fit(compose_config([*tiny, "trainer.max_steps=6", *overrides]), run_dir=run_dir)


def test_two_loggers_at_once_both_get_every_step(tmp_path: Path) -> None:
    fit(tmp_path / "run", "logger=[tensorboard,csv]", "logger.tensorboard.flush_secs=1")
    steps = [int(r["step"]) for r in csv_rows(tmp_path / "run" / "metrics.csv")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in scalars(tmp_path / "run" / "tensorboard")["train/loss"]] == steps


def test_logger_none_writes_no_logger_files(tmp_path: Path) -> None:
    metrics = fit(tmp_path / "run", "logger=none")
    assert metrics["step"] == 6
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert "tensorboard" not in files and "metrics.csv" not in files and "metrics.json" in files


def test_a_run_resumed_from_its_checkpoint_logs_no_step_twice(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fit(run_dir, "logger=csv", "trainer.ckpt_every_n_steps=3")
    fit(run_dir, "logger=csv", f"trainer.ckpt_path={run_dir / 'checkpoints' / 'step-000003.ckpt'}")
    rows = csv_rows(run_dir / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]


def test_a_logger_of_your_own_by_target(tmp_path: Path) -> None:
    RecordingLogger.calls = []
    fit(tmp_path / "run", "logger=none", f"+logger.mine._target_={__name__}.RecordingLogger",
        "+logger.mine.tag=x")
    # Built once in a scratch folder while the config is validated, then for the run with its folder.
    assert [c for c in RecordingLogger.calls if c[0] == "init"][-1] == ("init", "run", "x")
    calls = RecordingLogger.calls[RecordingLogger.calls.index(("init", "run", "x")):]
    assert [c[1] for c in calls if c[0] == "log_metrics" and "train/loss" in c[2]] == [1, 2, 3, 4, 5, 6]
    assert ("log_hyperparams", True) in calls and calls[-1] == ("finalize",)


@pytest.mark.parametrize(("project", "found"), [("team/project", "'/'"), ("a#b", "'#'"), ("run:1", "':'"),
                                                ("x" * 129, "exceeded 128 characters")])
def test_a_wandb_project_name_wandb_rejects_is_one_line_before_launch(tmp_path: Path, project: str,
                                                                      found: str) -> None:
    """W&B refused it only at wandb.init, the first log, after the workers had trained (54 lines of traceback)."""
    pytest.importorskip("wandb")
    from runner.checks import validate
    from runner.config import ConfigError

    cfg = compose_config([*(o for o in TINY if not o.startswith("logger.")), "logger=wandb",
                          f"logger.wandb.project='{project}'"])  # quoted: # and : are Hydra's
    with pytest.raises(ConfigError) as raised:
        validate(cfg)
    assert f"project={project} is not allowed: Invalid project name '{project}'" in str(raised.value)
    assert found in str(raised.value) and len(raised.value.problems) == 1
    assert ("logger.wandb.entity" in str(raised.value)) == ("/" in project)
