"""A node lost under torchrun: each surviving rank ends in the runner's one line, not Hydra's report of gloo's
traceback. Two torchrun agents on this machine stand for two nodes; one of them and its worker are SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _dist import clean_environ, free_port
from test_reliability import TESTS, wait_for


def _node(rank: int, port: int, run_dir: Path, cwd: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "runner",
               "strategy=ddp", "accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=2",
               "model._target_=reliability_models.Slow", "+model.delay=0.2", "data.num_samples=2048",
               "data.val_samples=64", "data.batch_size=16", f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(command, cwd=cwd, env=clean_environ(PYTHONPATH=str(TESTS)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
def test_a_lost_node_ends_the_surviving_rank_in_one_line(tmp_path: Path) -> None:
    run_dir, port = tmp_path / "run", free_port()
    first, second = (_node(rank, port, run_dir, tmp_path) for rank in (0, 1))
    try:
        log = run_dir / "runner.log"
        assert wait_for(lambda: log.exists() and "starting at step" in log.read_text(), 120)
        time.sleep(2)
        for pid in (*_children(second.pid), second.pid):  # the node goes: its agent and its worker at once
            os.kill(pid, signal.SIGKILL)
        _, stderr = first.communicate(timeout=90)
    finally:
        for job in (first, second):
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
            job.communicate(timeout=10)
    assert first.returncode != 0
    assert "error: rank 0: another process of the job went away (" in stderr, stderr
    assert "a node or a rank was lost, and its own log or launcher says why" in stderr
    assert "Error executing job" not in stderr and "gloo/transport" not in stderr, stderr
    assert "Traceback" in log.read_text()  # the transport's own, in the rank's log
