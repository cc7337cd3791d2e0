"""The launcher keeps its promises: one live run per folder, nothing listening beyond loopback on one node, a stuck
rank named with its stack, and a handled failure of one rank said once."""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

import trust_models
from _dist import TESTS_DIR, clean_environ, run_cli
from runner import run_lock
from runner.heartbeat import StallWatch

DDP = ["strategy=ddp", "accelerator=cpu", "trainer.devices=2", "logger=none"]
# The two runs: the same folder, different lengths and seeds.
TWO_RUNS = [*DDP, "data.num_samples=2048", "data.val_samples=64", "data.batch_size=16"]


def start_cli(args: list[str], env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=TESTS_DIR,
                            env=env if env is not None else clean_environ(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(condition, timeout: float, what: str, process: Optional[subprocess.Popen] = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            out, err = process.communicate()
            raise AssertionError(f"the job ended (exit {process.returncode}) before {what}\n{out}\n{err}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def lock_holder(run_dir: Path) -> str:
    path = run_dir / run_lock.LOCK_FILE
    return path.read_text().strip() if path.exists() else ""


def end(process: subprocess.Popen) -> tuple[str, str]:
    """Stop a job still running (SIGTERM to its session: the launcher and its workers) and collect its output."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    try:
        return process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()


# -- one run per folder ------------------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from runner import run_lock
run_lock.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_runs_folder_is_free_and_a_live_one_names_its_process(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=clean_environ())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.RunFolderBusy, match=f"{tmp_path} is in use by a running job \\(process "
                                                         f"{holder.pid}\\)"):
            run_lock.acquire(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    run_lock.acquire(tmp_path)  # the kernel released the killed process's lock
    try:
        assert lock_holder(tmp_path) == str(os.getpid())
    finally:
        run_lock.release(tmp_path)


def test_the_process_holding_a_folder_takes_it_again(tmp_path: Path) -> None:
    """The command line takes the folder before Hydra writes there, and fit() takes it once more."""
    run_lock.acquire(tmp_path)
    run_lock.acquire(tmp_path)
    run_lock.release(tmp_path)
    probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(600)", ""), str(tmp_path)],
                           capture_output=True, text=True, env=clean_environ(), timeout=60)
    assert "RunFolderBusy" in probe.stderr  # still held once
    run_lock.release(tmp_path)
    probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(600)", ""), str(tmp_path)],
                           capture_output=True, text=True, env=clean_environ(), timeout=60)
    assert probe.returncode == 0, probe.stderr


# -- nothing listens beyond loopback ---------------------------------------------------------------

def _family_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    except OSError:
        pass
    return inodes


def _listening() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every TCP socket in the LISTEN state (state 0A) on this machine."""
    found = {}
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        for line in path.read_text().splitlines()[1:] if path.exists() else ():
            fields = line.split()
            if fields[3] != "0A":
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc writes each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found[fields[9]] = (str(ipaddress.ip_address(raw)), int(port, 16))
    return found


def listening_sockets(root: int) -> set[tuple[int, str, int]]:
    listening = _listening()
    return {(pid, *listening[inode]) for pid in _family_tree(root) for inode in _socket_inodes(pid)
            if inode in listening}


def _outward_interface() -> Optional[str]:
    """A network interface other than loopback that gloo can use, if this machine has one."""
    import torch.distributed as dist

    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            continue
        try:
            dist.ProcessGroupGloo.create_device(interface=name)
        except RuntimeError:
            continue
        return name
    return None


def _training(run_dir: Path) -> bool:
    log = run_dir / "runner.log"
    return (run_dir / "rank_1.log").exists() and log.exists() and "global batch" in log.read_text()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
def test_a_live_run_keeps_its_folder_its_config_and_listens_on_loopback_alone(tmp_path: Path) -> None:
    """The issue's two runs in one folder: the second is refused, the first trains its own config. Meanwhile
    every socket the first job's processes listen on (the launcher's store, each worker's gloo) is on loopback,
    even with gloo's interface set outward in the environment."""
    run_dir = tmp_path / "same"
    env = clean_environ()
    outward = _outward_interface()
    if outward:  # gloo would listen there if the launcher left the workers' interface to the environment
        env["GLOO_SOCKET_IFNAME"] = outward
    first = start_cli([*TWO_RUNS, "trainer.max_steps=1000", "trainer.seed=1", f"hydra.run.dir={run_dir}"], env)
    try:
        wait_for(lambda: lock_holder(run_dir) == str(first.pid), 60, "lock of the first run", first)
        second = start_cli([*TWO_RUNS, "trainer.max_steps=1500", "trainer.seed=2", f"hydra.run.dir={run_dir}"])
        wait_for(lambda: _training(run_dir), 120, "training", first)
        seen: set[tuple[int, str, int]] = set()
        for _ in range(10):
            seen |= listening_sockets(first.pid)
            time.sleep(0.1)
        _, refused = second.communicate(timeout=120)
        out, err = first.communicate(timeout=240)
    finally:
        end(first)
    assert second.returncode == 1, refused
    lines = [line for line in refused.splitlines() if line.strip()]
    assert lines == [f"error: {run_dir} is in use by a running job (process {first.pid}); wait for it to end, or "
                     "choose another folder with hydra.run.dir=<folder>"], refused
    assert first.returncode == 0, err
    assert "trainer.max_steps=1000 decides the length" in err
    assert "max_steps=1500" not in (run_dir / "runner.log").read_text()
    # The refused run wrote nothing: Hydra's record of the folder is the first run's, and the lock is gone.
    assert "trainer.seed=1" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "max_steps: 1000" in (run_dir / ".hydra" / "resolved.yaml").read_text()
    assert '"step": 1000' in (run_dir / "metrics.json").read_text()
    assert not (run_dir / run_lock.LOCK_FILE).exists()
    assert len({pid for pid, _, _ in seen}) >= 3, seen  # the launcher's store and each worker's connections
    outside = [s for s in seen if not ipaddress.ip_address(s[1]).is_loopback]
    assert outside == [], f"listening beyond loopback: {outside} (all: {sorted(seen)})"


def _own_listeners(rank: int) -> list[str]:
    from runner.strategies import DDPStrategy

    strategy = DDPStrategy()
    strategy.setup_environment()  # rank 0 hosts the store at MASTER_ADDR=127.0.0.1
    try:
        return sorted(address for _, address, _ in listening_sockets(os.getpid()))
    finally:
        strategy.teardown()


def test_ranks_started_elsewhere_on_loopback_listen_there_alone() -> None:
    """Ranks whose MASTER_ADDR is loopback (started by a test, a notebook): rank 0's store serves there alone."""
    from _dist import run_ranks

    listeners = run_ranks(_own_listeners, world_size=2, timeout=120)
    assert listeners[0], "rank 0 hosts the store"
    assert all(ipaddress.ip_address(a).is_loopback for ranks in listeners for a in ranks), listeners


# -- a stuck rank is named --------------------------------------------------------------------------

SLEEP_LINE = next(number for number, line in enumerate(inspect.getsourcelines(trust_models.SleepOnRank)[0],
                                                        inspect.getsourcelines(trust_models.SleepOnRank)[1])
                  if "time.sleep(" in line)
RANK_FAULT = ["~model.hidden", "~model.depth", "data.num_samples=512", "data.val_samples=32", "data.batch_size=4",
              "trainer.max_steps=100000"]


@pytest.mark.slow
def test_a_rank_stuck_in_its_step_is_named_with_its_stack(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = run_cli([*DDP, "model._target_=trust_models.SleepOnRank", *RANK_FAULT, "strategy.stall_timeout=5",
                      f"hydra.run.dir={run_dir}"], cwd=TESTS_DIR, timeout=150)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert "error: rank 1 made no progress for " in result.stderr, result.stderr
    assert " s in step 3, while the other ranks waited for it (strategy.stall_timeout=5)" in result.stderr
    assert f'trust_models.py", line {SLEEP_LINE} in happen' in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"line {SLEEP_LINE} in happen" in (run_dir / "rank_1.log").read_text()  # the whole dump is kept there
    # Start-up takes a few seconds on a loaded machine; the stall itself is found after 5 s, not 30 minutes.
    assert elapsed < 90, elapsed


@pytest.mark.slow
def test_signals_after_the_run_finished_are_no_error_and_hold_the_job_no_longer_than_the_stall_timeout(
        tmp_path: Path) -> None:
    """Rank 1 gets SIGTERM as it exits after `done:`, then SIGSTOP: the SIGTERM was reported as a failure (exit 1),
    and the stopped rank held the job until someone sent SIGCONT (the watch ended with the loop)."""
    run_dir = tmp_path / "run"
    start = time.monotonic()
    # popen workers: the model's exit handlers send the signals, and a forked worker runs none (multiprocessing).
    result = run_cli([*DDP, "model._target_=trust_models.SignalsItselfAtExit", *RANK_FAULT, "trainer.max_steps=2",
                      "strategy.stall_timeout=5", "strategy.start_method=popen", f"hydra.run.dir={run_dir}"],
                     cwd=TESTS_DIR, timeout=150)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "done:" in output and "Traceback" not in output, output
    assert "rank 1 made no progress for " in output, output
    assert (" s in its exit (after the run), after the other ranks had ended; it is "
            "stopped (SIGSTOP, or Ctrl-Z; SIGCONT would resume it) (strategy.stall_timeout=5); the job was ended: the "
            "run had finished, its checkpoints and metrics.json are whole.") in output, output
    assert "received SIGTERM after the run had finished: nothing left to stop" in (run_dir / "rank_1.log").read_text()
    assert elapsed < 90, elapsed


def _beat(folder: Path, rank: int, pid: int, step: int, ticks: int, paused: int = 0, steps: int = 1) -> None:
    (folder / str(rank)).write_text(f"{pid} {step} {ticks} {paused} {steps}".ljust(64))


def test_the_watch_blames_the_least_advanced_rank_once_armed(tmp_path: Path) -> None:
    watch = StallWatch(tmp_path, 2, timeout=5, run_dir=tmp_path)
    _beat(tmp_path, 0, 10, 0, 0, steps=1)
    _beat(tmp_path, 1, 11, 0, 0, steps=1)
    assert watch.check(0.0) == []
    assert watch.check(100.0) == [], "a first step (compiling, warming up) is not watched"
    _beat(tmp_path, 0, 10, 2, 1, steps=3)  # finished its forward of step 3, waits in the reduction
    _beat(tmp_path, 1, 11, 2, 0, steps=3)  # still in its forward
    assert watch.check(101.0) == []
    assert watch.check(105.5) == []
    assert watch.check(106.5) == [1]


def test_once_a_rank_has_finished_and_ended_the_others_get_the_exit_grace(tmp_path: Path) -> None:
    """A rank that finished and exited waits for nobody (not the quiet ranks' peer at one point); the rank still
    there is named after EXIT_GRACE_S, not the stall timeout's minutes."""
    from runner.heartbeat import DONE, END, EXIT_GRACE_S

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(timeout=30)
    watch = StallWatch(tmp_path, 2, timeout=300, run_dir=tmp_path)
    (tmp_path / "0").write_text(f"{ended.pid} 9 0 0 10 {DONE} its exit (after the run)".ljust(64))
    (tmp_path / "1").write_text(f"{os.getpid()} 9 0 0 10 {END} the end of the run (after its last step)".ljust(64))
    assert watch.check(0.0) == [] and watch.check(EXIT_GRACE_S - 1) == []
    assert watch.check(EXIT_GRACE_S + 1) == [1]


def test_a_stopped_rank_is_named_even_where_the_others_wait_at_its_point(tmp_path: Path) -> None:
    """Ranks quiet at one point are not ended (none waits for another), unless one of them is stopped (SIGSTOP): a
    rank stopped before the run's last barrier held the others there until strategy.timeout."""
    from runner.heartbeat import END
    from runner.processes import state

    stopped = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        wait_for(lambda: state(stopped.pid) == "T", 10, "the process stopped")
        watch = StallWatch(tmp_path, 2, timeout=5, run_dir=tmp_path)
        for rank, pid in ((0, os.getpid()), (1, stopped.pid)):
            (tmp_path / str(rank)).write_text(f"{pid} 9 0 0 10 {END} the end of the run".ljust(64))
        assert watch.check(0.0) == [] and watch.check(4.0) == []
        assert watch.check(6.0) == [1]
    finally:
        stopped.kill()
        stopped.wait(timeout=10)


def test_the_watch_waits_for_saves_and_for_the_slowest_pause_seen(tmp_path: Path) -> None:
    watch = StallWatch(tmp_path, 2, timeout=5, run_dir=tmp_path)
    for now, step in ((0.0, 4), (1.0, 5), (21.0, 6)):  # a step of 20 s: ten times that is allowed
        _beat(tmp_path, 0, 10, step, 0, steps=step)
        _beat(tmp_path, 1, 11, step, 0, steps=step)
        assert watch.check(now) == []
    _beat(tmp_path, 0, 10, 6, 1, steps=6)  # rank 0 goes on to its reduction, rank 1 stays in its forward
    assert watch.check(22.0) == []
    assert watch.check(220.0) == [], "within ten times the 20 s step"
    assert watch.check(222.0) == [1]
    watch = StallWatch(tmp_path, 2, timeout=5, run_dir=tmp_path)
    _beat(tmp_path, 0, 12, 7, 0, paused=1, steps=3)  # saving a checkpoint
    _beat(tmp_path, 1, 13, 7, 0, paused=1, steps=3)
    assert watch.check(0.0) == [] and watch.check(1000.0) == []


# -- a handled failure is said once -------------------------------------------------------------

@pytest.mark.slow
def test_a_handled_failure_of_one_rank_is_said_once_without_the_peers_traceback(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli([*DDP, "model._target_=trust_models.BatchErrorOnRank", "+model.rank=0", *RANK_FAULT,
                      f"hydra.run.dir={run_dir}"], cwd=TESTS_DIR, timeout=150)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count("the batch of step 3 has no labels (injected on rank 0)") == 1, output
    assert "error: rank 0: " in result.stderr
    assert "Traceback" not in output, output
    assert "Connection closed" not in output, output
    # The peer's side of it stays in its own log (when it saw rank 0 go before the launcher stopped it): nothing of
    # it reaches the console.
    assert "rank 1" not in result.stderr.replace("[rank 1]", ""), output


def test_after_ending_an_attempt_the_watch_follows_the_restarted_one(tmp_path: Path) -> None:
    """trainer.max_restarts: the restarted workers are watched from their own records, and the stall message
    of the ended attempt is dropped once they beat."""
    with StallWatch(tmp_path, 2, timeout=0.5, run_dir=tmp_path) as watch:
        workers = [subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGUSR2, "
                                     "signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
                                    stdout=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            assert all(w.stdout.readline().strip() == "ready" for w in workers)  # workers without stacks to dump
            _beat(tmp_path, 0, workers[0].pid, 5, 0, steps=3)
            _beat(tmp_path, 1, workers[1].pid, 5, 1, steps=3)  # waits for rank 0 in the step's reduction
            wait_for(lambda: watch.message is not None, 30, "stall message")
            assert [w.wait(timeout=30) for w in workers] == [-signal.SIGKILL] * 2
        finally:
            for w in workers:
                w.kill()
        assert "rank 0 made no progress" in watch.message and "in step 6" in watch.message
        wait_for(lambda: not (tmp_path / "0").exists(), 30, "the ended attempt's record removed")
        _beat(tmp_path, 0, os.getpid(), 0, 0, steps=1)
        wait_for(lambda: watch.message is None, 30, "message dropped for the restarted attempt")


@pytest.mark.parametrize("stall, timeout, limit, named", [
    (300, 1800, 300, "strategy.stall_timeout=300"),
    (5, 1800, 5, "strategy.stall_timeout=5"),
    # The collectives would give up first and blame a rank that waited: the watch comes before them.
    (300, 30, 24, "strategy.stall_timeout=300, kept below strategy.timeout=30"),
    (300, 2, 300, "strategy.stall_timeout=300"),  # a timeout this short is the user's own watch
    (None, 30, None, None), (0, 30, None, None)])
def test_the_stall_limit_comes_before_the_collectives_timeout(stall: Optional[float], timeout: float,
                                                              limit: Optional[float], named: Optional[str]) -> None:
    import torch

    from runner.strategies import DDPStrategy

    from runner.launch import launcher_for

    launcher = launcher_for(DDPStrategy(parallel_devices=[torch.device("cpu")] * 2, stall_timeout=stall,
                                        timeout=timeout).processes)
    assert launcher.stall_timeout == limit
    if named:
        assert launcher.stall_setting == named


@pytest.mark.parametrize("compiled", [False, True])
def test_beats_come_from_the_step_its_forward_passes_and_the_optimizer(tmp_path: Path, compiled: bool) -> None:
    """A compiled module beats only at its steps: after the optimizer's step the watch rests until the next one,
    so a long validation is never taken for a stall."""
    import torch
    from types import SimpleNamespace

    from runner.callbacks import Callbacks
    from runner.heartbeat import Heartbeat, attach, read_beats

    task = torch.nn.Linear(2, 1)
    loop = SimpleNamespace(task=task, optimizer=torch.optim.SGD(task.parameters(), lr=0.1), callbacks=Callbacks())
    attach(Heartbeat(tmp_path, 0), loop, compiled=compiled)
    loop.heartbeat.step(7)
    task(torch.ones(1, 2)).sum().backward()
    loop.optimizer.step()
    beat = read_beats(tmp_path)[0]
    assert (beat.pid, beat.step, beat.steps) == (os.getpid(), 7, 1)
    assert (beat.ticks, beat.paused) == ((1, True) if compiled else (2, False))
    task.eval()
    task(torch.ones(1, 2))  # a validation batch
    assert read_beats(tmp_path)[0].ticks == (1 if compiled else 3)
    loop.callbacks.call("on_save_checkpoint", loop, {})
    assert read_beats(tmp_path)[0].paused
    loop.callbacks.call("on_checkpoint_saved", loop, tmp_path)
    loop.heartbeat.step(8)
    assert not read_beats(tmp_path)[0].paused and read_beats(tmp_path)[0].steps == 2


def test_ranks_quiet_together_at_one_point_are_not_ended(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A callback, upload or metric that is slow on every rank leaves no rank waiting for another: said, not ended."""
    watch = StallWatch(tmp_path, 2, timeout=5, run_dir=tmp_path)
    for now, step in ((0.0, 4), (1.0, 5)):
        _beat(tmp_path, 0, 10, step, 1, steps=step)
        _beat(tmp_path, 1, 11, step, 1, steps=step)
        assert watch.check(now) == []
    with caplog.at_level("WARNING", logger="runner"):
        assert watch.check(100.0) == [] and watch.check(200.0) == []
    said = [r.getMessage() for r in caplog.records if "quiet" in r.getMessage()]
    assert len(said) == 1 and "same point of step 6" in said[0]
    _beat(tmp_path, 0, 10, 5, 2, steps=5)  # rank 0 moves on and waits: rank 1 is now the one stuck
    assert watch.check(201.0) == []  # the 200 s pause is the slowest seen now: ten times it is allowed
    assert watch.check(2202.0) == [1]


@pytest.mark.parametrize("rank, log", [(0, "runner.log"), (1, "rank_1.log")])
def test_a_killed_rank_is_named_with_the_log_it_writes(tmp_path: Path, rank: int, log: str) -> None:
    """The line named rank_0.log, which never exists: rank 0 writes runner.log."""
    from types import SimpleNamespace

    from runner.launch import _describe

    killed = SimpleNamespace(exitcode=-signal.SIGKILL, signal_name=lambda: "SIGKILL", error_file_data=None)
    assert _describe(rank, killed, tmp_path) == f"rank {rank} was killed by SIGKILL (see its log: {tmp_path / log})"
