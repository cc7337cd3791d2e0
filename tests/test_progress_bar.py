"""The console's progress: tqdm bars for training and validation on a terminal (trainer.progress_bar=auto), plain
log lines through a pipe or with trainer.progress_bar=false, and plain lines when tqdm is not installed."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import DictConfig

import runner
from _dist import assert_ok, clean_environ, run_cli
from conftest import TINY

MakeCfg = Callable[..., DictConfig]

# 20 steps over 16 an epoch: validations at 16 and 20, a log every 5 steps.
RUN = [*TINY, "trainer.max_steps=20", "trainer.log_every_n_steps=5"]
BAR_END = r"\rtrain: 100%\|[^\r]*\| 20/20 \[[^\]]*step/s, epoch 1, loss \d\.\d{4}, \d+ samples/s\]"
LINE_END = re.compile(r"step 20/20  epoch 1  loss \d\.\d{4}  \d+ samples/s  eta 0s")


def run_in_terminal(args: list[str], cwd: Path) -> tuple[int, str]:
    """`python -m runner *args` with stdout and stderr on a terminal of 120 columns; its exit code and output."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=cwd, env=clean_environ(TERM="xterm"),
                            stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks = []
    try:
        while chunk := os.read(controller, 65536):
            chunks.append(chunk)
    except OSError:  # EIO: the process closed its end of the terminal
        pass
    finally:
        os.close(controller)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


def test_a_terminal_shows_a_bar_for_training_and_for_each_validation(tmp_path: Path) -> None:
    code, out = run_in_terminal([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert code == 0, out
    assert re.search(BAR_END, out), out  # steps, rate and ETA; the last log step's loss in its tail
    assert "\rval:   0%|" in out and "0/4 [" in out  # 4 validation batches, counted on a bar of their own
    assert not LINE_END.search(out)  # no progress lines beside the bar
    # A log line clears the bar and starts a line of its own; the bar comes back under it.
    val_line = out.index("step 16  val/loss")
    assert re.search(r"\r *\r\[[^\n]*$", out[:val_line]), out[:val_line]
    assert "\rtrain:" in out[val_line:]


def test_progress_bar_false_prints_lines_on_a_terminal(tmp_path: Path) -> None:
    code, out = run_in_terminal([*RUN, "trainer.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert code == 0, out
    assert "%|" not in out and not re.search(r"\r(?!\n)", out), out  # the terminal ends its lines with \r\n
    assert LINE_END.search(out), out


def test_a_pipe_gets_plain_lines_without_carriage_returns(tmp_path: Path) -> None:
    result = run_cli([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert_ok(result)
    out = result.stdout + result.stderr
    assert "\r" not in out and "%|" not in out
    assert LINE_END.search(out), out


def test_progress_bar_true_draws_the_bar_without_a_terminal(make_cfg: MakeCfg, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    runner.fit(make_cfg("trainer.max_steps=4", "trainer.progress_bar=true"), run_dir=tmp_path)
    err = capsys.readouterr().err
    assert re.search(r"\rtrain: 100%\|[^\r]*\| 4/4 \[[^\]]*step/s, epoch 0, loss \d\.\d{4}", err), err
    assert "step 4/4" not in (tmp_path / "runner.log").read_text()


def test_without_tqdm_a_bar_falls_back_to_lines(make_cfg: MakeCfg, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` fails, as where it is not installed
    runner.fit(make_cfg("trainer.max_steps=4", "trainer.progress_bar=true"), run_dir=tmp_path)
    log = (tmp_path / "runner.log").read_text()
    assert "trainer.progress_bar=true needs tqdm, which is not installed (pip install tqdm)" in log
    assert re.search(r"step 4/4  epoch 0  loss \d\.\d{4}", log)
    assert "\r" not in capsys.readouterr().err


def test_summary_lines_leave_nested_records_to_metrics_json() -> None:
    from runner.loop.progress import fmt

    line = fmt({"val/loss": 0.123456, "step": 20, "run": {"devices": "1 × cpu"}, "best": {"value": 0.1}})
    assert line == "val/loss 0.1235  step 20"
