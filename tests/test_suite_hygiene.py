"""The suite cleans up after itself: a job a test starts ends with the test, pass or fail, or with an interrupted
suite, even when the job leads a process group of its own (as the signal tests' runs and sweeps do)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_environ
from runner.processes import alive

INNER = '''
import subprocess, sys, time
from pathlib import Path

def _start(name):
    # a job in a session of its own, with a child of its own: what `python -m runner` with workers looks like
    job = subprocess.Popen([sys.executable, "-c",
                            "import subprocess, sys, time; c = subprocess.Popen(['sleep', '300']); "
                            "print(c.pid, flush=True); time.sleep(300)"],
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = job.stdout.readline().strip()
    Path(name).write_text(f"{job.pid} {child}")

def test_fails_with_a_job_running():
    _start("failed.pids")
    assert False

def test_passes_with_a_job_running():
    _start("passed.pids")

def test_interrupted_with_a_job_running():
    _start("interrupted.pids")
    Path("ready").touch()
    time.sleep(300)
'''


def _pids(path: Path) -> list[int]:
    return [int(pid) for pid in path.read_text().split()]


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while any(alive(pid) and not _zombie(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def _inner_pytest(tmp_path: Path, *select: str) -> subprocess.Popen:
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**clean_environ(), "PYTHONPATH": str(REPO / "tests")}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                             "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py"), *select],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_a_tests_job_and_its_children_end_with_the_test_pass_or_fail(tmp_path: Path) -> None:
    inner = _inner_pytest(tmp_path, "-k", "fails or passes")
    out, _ = inner.communicate(timeout=120)
    assert "1 failed, 1 passed" in out, out
    for name in ("failed.pids", "passed.pids"):
        assert _gone(_pids(tmp_path / name)), f"{name}: still running after the suite ended"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_an_interrupted_suite_ends_the_jobs_its_tests_started(tmp_path: Path) -> None:
    inner = _inner_pytest(tmp_path, "-k", "interrupted")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and inner.poll() is None, inner.stdout.read() if inner.stdout else ""
            time.sleep(0.1)
        os.killpg(inner.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches pytest, not the job's own session
        inner.communicate(timeout=60)
        assert _gone(_pids(tmp_path / "interrupted.pids")), "the job went on after the suite was interrupted"
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
