"""Refusals a user meets before anything starts, each one line of the runner's own: a CPU process count far beyond
the cores, an option a config group does not have, a constructor that refuses its settings, a quoted number.
`runner.cli.main` runs in-process; nothing may start a process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import TINY, run_main
from runner.launch import ElasticLauncher

BASE = [*(o for o in TINY if not o.startswith("logger.")), "logger=none"]


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every attempt to start a worker or a process, recorded (and refused) instead of made."""
    started: list = []

    def refuse(*args: object, **kwargs: object) -> None:
        started.append(args)
        raise AssertionError("a process was started")

    monkeypatch.setattr(ElasticLauncher, "launch", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    return started


@pytest.mark.parametrize("stage", ["fit", "check"])
def test_a_cpu_process_count_far_beyond_the_cores_is_refused_before_any_process_starts(
        stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        nothing_starts: list) -> None:
    """trainer.devices=100000 on a 2-core machine started processes without bound, and stage=check said ok."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    code, output = run_main([*BASE, "strategy=ddp", "trainer.devices=100000", f"stage={stage}",
                             f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert code == 1, output
    assert ("trainer.devices=100000 would start 100000 CPU processes, and this process may use 2 cores "
            "(os.sched_getaffinity): beyond 8 they only slow one another and can exhaust the machine's memory; use "
            "trainer.devices=2 (one per core), or insist with trainer.oversubscribe_cpu=true") in output, output
    assert "Traceback" not in output and not nothing_starts
    assert not (tmp_path / "run" / ".hydra" / "resolved.yaml").exists()


def test_a_user_who_insists_may_oversubscribe(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                              nothing_starts: list) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    code, output = run_main([*BASE, "strategy=ddp", "trainer.devices=9", "trainer.oversubscribe_cpu=true",
                             "stage=check"], monkeypatch, capsys)
    assert code == 0, output


def test_a_named_pipe_as_the_checkpoint_is_refused_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    """Reading a FIFO waits for a writer: the run printed nothing for minutes. Should it wait, a writer that closes
    at once comes after 20 s, and the reader gets an empty file instead."""
    import threading
    import time

    pipe = tmp_path / "last.ckpt"
    os.mkfifo(pipe)

    def release() -> None:
        try:
            os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # nobody reads it: nothing to release
            pass

    writer = threading.Timer(20, release)
    writer.start()
    start = time.monotonic()
    try:
        code, output = run_main([*BASE, f"trainer.ckpt_path={pipe}", "stage=check"], monkeypatch, capsys)
    finally:
        writer.cancel()
    assert time.monotonic() - start < 15
    assert code == 1, output
    assert (f"trainer.ckpt_path={pipe}: {pipe} is a named pipe (FIFO), not a checkpoint file or folder: reading it "
            "could wait forever; name a checkpoint file (.ckpt) or a sharded checkpoint folder") in output, output


# -- a constructor that refuses its settings: its own words, not Hydra's "Error in call to target ... full_key" ------

@pytest.mark.parametrize(("overrides", "expected"), [
    (["strategy=ddp", "strategy.timeout=inf"],
     "strategy.timeout=inf must be a positive number of seconds (a finite one: 1800 is half an hour)"),
    (["strategy=ddp", "strategy.stall_timeout=-5"],
     "strategy.stall_timeout=-5.0 must be a number of seconds (0 or null: no watch)"),
    (["data.num_classes=1"], "data.num_classes=1 must be at least 2"),
    (["model._target_=user_models.RefusesItsSettings"],
     "model (user_models.RefusesItsSettings) raised ValueError: hidden=16 is not a size this model builds"),
], ids=["timeout-inf", "stall-timeout-negative", "one-class", "users-constructor"])
def test_a_constructors_refusal_is_its_own_line(overrides: list[str], expected: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                nothing_starts: list) -> None:
    run_dir = tmp_path / "run"
    code, output = run_main([*BASE, *overrides, f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    assert code == 1, output
    assert any(line.endswith(expected) for line in output.splitlines()), output
    assert "Error in call to target" not in output and "full_key" not in output and "Traceback" not in output
    if "user_models" in expected:  # the user's class: its traceback is for its author, in the run's log
        assert "user_models.py" in (run_dir / "runner.log").read_text()
    assert not nothing_starts


def test_a_launched_workers_constructor_failure_reaches_the_launcher_as_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launched worker (runner.worker.run_from_file, as under strategy=ddp) hands the launcher its line through
    torchelastic's error file, and keeps the traceback in its log."""
    import json

    from omegaconf import OmegaConf

    from conftest import compose_config
    from runner.worker import run_from_file

    config = tmp_path / "config.yaml"
    OmegaConf.save(compose_config([*BASE, "model._target_=user_models.RefusesItsSettings"]), config)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(SystemExit):
        run_from_file(str(config), str(tmp_path / "run"), os.getppid())
    said = json.loads((tmp_path / "error.json").read_text())["message"]["extraInfo"]["py_callstack"]
    assert said == "model (user_models.RefusesItsSettings) raised ValueError: hidden=16 is not a size this model builds"
    assert "user_models.py" in (tmp_path / "run" / "runner.log").read_text()


# -- an error in the user's own code: their frames and the error, the runner's frames in the log -------------------

def test_a_users_forward_that_raises_shows_the_users_frames_and_the_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """It printed ~100 lines of the runner's and torch's frames (Hydra's report of an unexpected error)."""
    run_dir = tmp_path / "run"
    code, output = run_main([*BASE, "model._target_=user_models.FailsInForward", f"hydra.run.dir={run_dir}"],
                            monkeypatch, capsys)
    assert code == 1, output
    said = [line for line in output.splitlines() if not line.startswith("[")]  # the log's lines start with a time
    assert said[0] == f"error: RuntimeError in your code (the runner's frames are in {run_dir / 'runner.log'}):"
    assert said[-1] == "RuntimeError: the user's helper cannot take a batch of 16"
    frames = [line for line in said if line.startswith("  File ")]
    assert [f.rsplit(", in ", 1)[1] for f in frames] == ["forward", "_helper"], output
    assert all("user_models.py" in f for f in frames) and "/runner/" not in "\n".join(said), output
    log = (run_dir / "runner.log").read_text()
    assert "runner/loop/step.py" in log and "user_models.py" in log  # the whole traceback, for a bug report


def test_a_launched_rank_hands_the_launcher_the_users_frames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher shows rank 0's report and compares the other ranks' last lines with it: the error comes last."""
    import json

    from omegaconf import OmegaConf

    from conftest import compose_config
    from runner.worker import run_from_file

    config = tmp_path / "config.yaml"
    OmegaConf.save(compose_config([*BASE, "model._target_=user_models.FailsInForward"]), config)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(SystemExit):
        run_from_file(str(config), str(tmp_path / "run"), os.getppid())
    said = json.loads((tmp_path / "error.json").read_text())["message"]["extraInfo"]["py_callstack"].splitlines()
    assert said[0] == f"RuntimeError in your code (the runner's frames are in {tmp_path / 'run' / 'runner.log'}):"
    assert said[-1] == "RuntimeError: the user's helper cannot take a batch of 16", said
    assert len([line for line in said if line.startswith("  File ")]) == 2, said


# -- another tool's weights as the checkpoint: what they are, not advice about pickles ----------------------------

@pytest.mark.parametrize("kind", ["safetensors", "damaged-safetensors", "hf-folder"])
def test_weights_in_another_format_are_named_as_such(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    """A safetensors file that failed got 'checkpoints must hold only tensors, dicts, lists and numbers' (advice about
    pickles); an HF folder was 'damaged, truncated or not a checkpoint; use an earlier checkpoint'."""
    import torch

    from runner.checkpoint_io.safetensors_io import save_file

    weights = tmp_path / ("hf" if kind == "hf-folder" else "w.safetensors")
    weights.parent.mkdir(exist_ok=True)
    if kind == "hf-folder":
        weights.mkdir()
        (weights / "config.json").write_text('{"model_type": "gpt2"}')
        save_file({"w": torch.zeros(3)}, weights / "model.safetensors")
    else:
        save_file({"w": torch.zeros(3)}, weights)
        if kind == "damaged-safetensors":
            weights.write_bytes(weights.read_bytes()[:-4])  # its header says more bytes than follow
    code, output = run_main([*BASE, f"trainer.ckpt_path={weights}", "stage=check"], monkeypatch, capsys)
    assert code == 1, output
    what = "a HuggingFace save_pretrained folder" if kind == "hf-folder" else "a safetensors file"
    assert (f"{what}: weights alone (as runner.export and save_pretrained write them), which no run resumes or "
            "evaluates from: name a runner checkpoint (a run's checkpoints/*.ckpt)") in output, output
    assert "tensors, dicts, lists and numbers" not in output and "earlier checkpoint" not in output


# -- under torchrun: the line in the error file torchelastic reads ------------------------------------------------

@pytest.mark.parametrize(("overrides", "expected"), [
    (["trainer.devices='2'"], "trainer.devices='2' is a string, not a number"),
    (["optimizer=lion"], "optimizer=lion is not an option of optimizer: adamw, parts, sgd"),
], ids=["refused-by-the-checks", "refused-while-composing"])
def test_a_refusal_is_written_where_torchelastic_reads_a_ranks_error(overrides: list[str], expected: str,
                                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """torchrun's own ChildFailedError report followed the runner's line with 'error_file: <N/A>' and a link."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    code, output = run_main([*BASE, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert code == 1 and expected in output, output
    failure = ProcessFailure(local_rank=0, pid=os.getpid(), exitcode=1, error_file=str(error_file))
    assert expected in failure.message["extraInfo"]["py_callstack"]  # what torchrun's report shows for the rank
