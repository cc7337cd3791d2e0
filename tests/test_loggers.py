"""The TensorBoard logger's event files: the record format TensorBoard checks, flushing, HParams, resume."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from runner.loggers import TensorBoardLogger


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


def test_a_logger_that_logs_nothing_writes_no_file(tmp_path: Path) -> None:
    TensorBoardLogger(str(tmp_path)).finalize()
    assert not (tmp_path / "tensorboard").exists()
