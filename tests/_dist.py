"""Test support for distributed runs: free ports, spawned gloo ranks, CLI subprocesses and clean-up fixtures."""

from __future__ import annotations

import os
import queue as queues
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS_DIR = Path(__file__).resolve().parent

# Variables that would make a child believe it was started by torchrun or srun.
LAUNCH_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without launch or SLURM variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    env.update(extra)
    return env


@pytest.fixture
def restore_environ():
    """Put os.environ back and leave no process group behind, whatever the test did."""
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


# -- spawned gloo ranks ----------------------------------------------------------------------------

def _entry(rank: int, world_size: int, port: int, queue: Any, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        queue.put((rank, True, fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank's traceback
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout: float = 60.0) -> list[Any]:
    """Run `fn(rank, *args)` in `world_size` spawned processes set up as torchrun would; return their results.

    `fn` must be importable (module level). A rank that raises fails the caller with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, queue, fn, args), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    results, error = {}, "interrupted"
    try:
        results, error = _collect(queue, procs, deadline)
    finally:
        # After a failure the other ranks may be stuck in a collective: give them a moment, then kill them.
        grace = 1.0 if error else max(1.0, deadline - time.monotonic())
        for proc in procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    if error:
        raise AssertionError(error)
    return [results[r] for r in range(world_size)]


def _collect(queue: Any, procs: list[Any], deadline: float) -> tuple[dict[int, Any], Optional[str]]:
    """Every rank's result, or the first failure (after which the others may wait forever on a collective)."""
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(set(range(len(procs))) - results.keys())} did not finish in time")
        try:
            rank, ok, value = queue.get(timeout=1.0)
        except queues.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead:
                return results, f"rank {dead[0][0]} died with exit code {dead[0][1]} before reporting"
            continue
        if not ok:
            return results, f"rank {rank}:\n{value}"
        results[rank] = value
    return results, None


# -- the command line ------------------------------------------------------------------------------

def run_cli(args: list[str], cwd: Optional[Path] = None, env: Optional[dict[str, str]] = None,
            timeout: float = 120.0, module: tuple[str, ...] = ("-m", "runner")) -> subprocess.CompletedProcess:
    """`python -m runner *args` in a clean environment; the result keeps stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, *module, *args], cwd=cwd, env=env if env is not None else clean_environ(),
        capture_output=True, text=True, timeout=timeout,
    )


def torchrun(args: list[str], nproc: int = 2, **kwargs: Any) -> subprocess.CompletedProcess:
    """The same as `torchrun --standalone --nproc-per-node=<nproc> -m runner *args`."""
    module = ("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "runner")
    return run_cli(args, module=module, **kwargs)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def assert_one_run_folder(run_dir: Path, world_size: int = 2) -> None:
    """What a finished DDP job leaves: one config, one event stream, one log per rank, final metrics."""
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert len(list(run_dir.rglob("config.yaml"))) == 1
    events = list(run_dir.rglob("events.out.tfevents.*"))
    assert len(events) == 1, events
    assert (run_dir / "runner.log").is_file()
    for rank in range(1, world_size):
        assert f"[rank {rank}]" in (run_dir / f"rank_{rank}.log").read_text()
    assert not (run_dir / "rank_0.log").exists()
    assert (run_dir / "metrics.json").is_file()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


def processes_mentioning(text: str) -> list[int]:
    """Ids of live processes whose command line contains `text` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if text in cmdline and "State:\tZ" not in status:
            found.append(int(entry.name))
    return found
