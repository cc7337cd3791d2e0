"""Shared fixtures: configs composed with Hydra's compose API, and clean global state around every test."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pytest

# The suite's test processes share the machine's cores (pytest -n 2): each, and each run it starts, computes on one
# thread, as the runner gives each of 2 local processes. torch's default, a thread per core in every process,
# oversubscribes them, and OpenMP's waiting threads then slowed an in-process training up to 7x when two coincided.
# Tests of the thread setting itself clear or set the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402 - after the thread count it reads
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from runner import cli
from runner.composition import register_configs
from runner.config import register_resolvers

REPO = Path(__file__).resolve().parent.parent
# The config groups as the repository keeps them (inside a wheel: runner/conf/).
CONF_DIR = REPO / "conf"

# A run of a few milliseconds per step on one CPU process, small enough for dozens of runs per test file.
TINY = (
    "accelerator=cpu",
    "strategy=single",
    "cluster=local",
    "trainer.devices=1",
    "trainer.max_steps=3",
    "trainer.max_epochs=-1",
    "trainer.log_every_n_steps=1",
    "data.num_samples=256",
    "data.val_samples=64",
    "data.batch_size=16",
    "data.num_features=8",
    "model.hidden=16",
    "logger.tensorboard.flush_secs=1",
)

# Variables that would make the runner think torchrun or SLURM started it.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "LOCAL_WORLD_SIZE", "HYDRA_FULL_ERROR")


def clean_environ() -> dict[str, str]:
    """os.environ without launcher, torchrun or SLURM variables: what a user's plain shell looks like."""
    return {k: v for k, v in os.environ.items()
            if k not in LAUNCHER_VARIABLES and not k.startswith(("TORCHELASTIC_", "SLURM_"))}


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python -m runner <overrides>` would run (without the `hydra` node)."""
    register_resolvers()
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def make_cfg() -> Callable[..., DictConfig]:
    """`make_cfg("optimizer=sgd", ...)`: the tiny CPU config with extra overrides (later ones win)."""

    def make(*overrides: str) -> DictConfig:
        return compose_config([*TINY, *overrides])

    return make


@pytest.fixture
def cfg(make_cfg: Callable[..., DictConfig]) -> DictConfig:
    return make_cfg()


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start as a plain local process even when the suite itself runs under torchrun or srun."""
    for key in os.environ:
        if key in LAUNCHER_VARIABLES or key.startswith(("TORCHELASTIC_", "SLURM_")):
            monkeypatch.delenv(key)


# Every process the tests start, with whether it leads a process group of its own (start_new_session): such a job
# (a run, a sweep, torchrun) does not get the terminal's Ctrl-C, and its workers would train on after the test.
# And the thread that started it: a module fixture's pool may still be starting its runs while a test runs.
_STARTED: list[tuple[subprocess.Popen, bool, int]] = []
_popen_init = subprocess.Popen.__init__


def _recorded_init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
    _popen_init(self, *args, **kwargs)
    leads = bool(kwargs.get("start_new_session")) or kwargs.get("process_group") == 0
    _STARTED.append((self, leads, threading.get_ident()))


subprocess.Popen.__init__ = _recorded_init  # type: ignore[method-assign]


def _kill_started(since: int = 0, thread: Optional[int] = None) -> None:
    """SIGKILL what was started (after `since`, by `thread` if given) and still runs: a group leader's whole group,
    its workers with it."""
    for process, leads_group, starter in _STARTED[since:]:
        if process.poll() is not None or thread not in (None, starter):
            continue
        try:
            if leads_group:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
            process.wait(timeout=10)
        except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
            pass


atexit.register(_kill_started)  # an interrupted suite (Ctrl-C, a timeout) ends its jobs too


def _end_wandb_service(since: int) -> None:
    """W&B's service, started by a test in this process, ends through W&B: killed, W&B's own exit handler would
    print a ConnectionResetError traceback at the end of the suite."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and any(p.poll() is None and "wandb" in str(p.args) for p, _, _ in _STARTED[since:]):
        try:
            wandb.teardown()
        except Exception:  # noqa: BLE001 - the process is killed next either way
            pass


@pytest.fixture(autouse=True)
def _end_started_processes():
    """Pass or fail, the jobs a test starts end with it (a module fixture's processes are the fixture's to end)."""
    since = len(_STARTED)
    yield
    _end_wandb_service(since)
    _kill_started(since, threading.get_ident())
    _STARTED[:] = [entry for entry in _STARTED if entry[0].poll() is None]  # keep the list short


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _destroy_process_group():
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Runs configure the root logger (run-folder log files), the runner's own logger (its files and console, no
    propagation) and torch flags; each test starts from the loggers as this test process first had them (a run in a
    module or session fixture, set up before this, changes them too), and they are put back after it, so that a
    test's output reaches its own capture."""
    _pristine_loggers()
    root, runner_log = logging.getLogger(), logging.getLogger("runner")
    handlers, level = list(root.handlers), root.level
    runner_state = (list(runner_log.handlers), runner_log.level, runner_log.propagate)
    deterministic = torch.are_deterministic_algorithms_enabled()
    dtype = torch.get_default_dtype()
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers, root.level = handlers, level
    for handler in runner_log.handlers:
        if handler not in runner_state[0]:
            handler.close()
    runner_log.handlers, runner_log.level, runner_log.propagate = runner_state
    torch.use_deterministic_algorithms(deterministic)
    torch.set_default_dtype(dtype)
    GlobalHydra.instance().clear()


# The root and runner loggers as this test process had them when the tests were collected.
_PRISTINE = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).level,
                    logging.getLogger(name).propagate) for name in ("", "runner")}


def _pristine_loggers() -> None:
    """The root and runner loggers back to _PRISTINE, closing the handlers added since (pytest's own capture
    handlers on the root logger are kept: they belong to the running test)."""
    for name, (handlers, level, propagate) in _PRISTINE.items():
        log = logging.getLogger(name)
        keep = [h for h in log.handlers if h in handlers or type(h).__module__.startswith("_pytest")]
        for handler in log.handlers:
            if handler not in keep:
                handler.close()
        log.handlers, log.level, log.propagate = keep, level, propagate


def val_loss_of(cfg: DictConfig, weights: dict) -> float:
    """The mean cross-entropy of `weights` over the config's whole validation set, computed by hand."""
    from runner.build import build_data, build_model

    model = build_model(cfg)
    model.load_state_dict(weights)
    data = build_data(cfg).val_dataset
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(data.inputs), data.targets).item()


def load_checkpoint(run_dir: Path, name: str = "last.ckpt") -> dict:
    return torch.load(Path(run_dir) / "checkpoints" / name, map_location="cpu", weights_only=True)


def read_events(run_dir: Path) -> Any:
    """The run's single TensorBoard event file (an EventAccumulator), every scalar kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((Path(run_dir) / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, f"expected one event file, found {files}"
    events = EventAccumulator(str(files[0]), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def scalar_steps(run_dir: Path, tag: str) -> list[int]:
    return [event.step for event in read_events(run_dir).Scalars(tag)]


def run_main(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """`python -m runner *args` in this process: the exit code and what it printed."""
    monkeypatch.setattr(sys, "argv", ["runner", *args])
    code: Optional[int] = 0
    try:
        cli.main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out + captured.err
