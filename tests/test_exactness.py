"""The exactness oracle: drawn combinations of data kind, process count, loader workers, accumulation, synced batch
norm, and a stop by a real SIGTERM at a drawn step on a drawn rank resumed on a drawn process count, each trained
for a few float64 steps and compared with the one-process reference: the weights and every logged number equal
within 1e-9, or the run refused in one line before training. And the faulty data a user may bring (a len() that
lies, a stream read once, streams that differ over ranks, a state no checkpoint can hold, an endless evaluation
stream): each refused in one line, never trained on silently and never waited on.

The reference of a case is the run of one process at the same global batch and accumulation (batch norm takes its
statistics per micro-batch, which the synced processes take together). CI draws ORACLE_DRAWS cases (every data kind
at least once) from ORACLE_SEED; `pytest -m nightly` draws NIGHTLY_DRAWS more, from the environment's
RUNNER_ORACLE_SEED when set. Each case's parameters are its test id, so a failure names what to run again.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import re
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import runner
import runner.worker
from runner.config import ConfigError
from runner.errors import JobStopped, is_user_error
from runner.loop.stop import MAX_INTERVAL, PROBE_STEPS

from exactness_data import KINDS, LOADER_KINDS

TESTS = Path(__file__).resolve().parent
CONF = TESTS / "exactness_conf"
GLOBAL_BATCH, STEPS, STEPS_PER_EPOCH = 12, 11, 8
ORACLE_SEED, ORACLE_DRAWS, NIGHTLY_DRAWS = 37, 12, 150
TOLERANCE = 1e-9
# Logged values that measure the machine, not the training.
_TIMED = ("throughput/",)

pytestmark = pytest.mark.xdist_group("exactness")


@pytest.fixture(autouse=True)
def _workers_import_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.syspath_prepend(str(TESTS))


@dataclass(frozen=True)
class Case:
    kind: str = "map"
    processes: int = 1
    workers: int = 0
    accumulate: int = 1
    batchnorm: bool = False
    stop_at: int = 0  # the optimizer step after which a rank gets SIGTERM (0: none)
    stop_rank: int = 0
    resume_on: int = 0  # the process count the stopped run resumes on

    def __str__(self) -> str:
        parts = [self.kind, f"{self.processes}p", f"w{self.workers}", f"acc{self.accumulate}",
                 *(["bn"] if self.batchnorm else []),
                 *([f"stop{self.stop_at}r{self.stop_rank}-resume{self.resume_on}p"] if self.stop_at else [])]
        return "-".join(parts)


def overrides(case: Case, processes: int, signal: bool = True) -> list[str]:
    """The command line of `case` on `processes` processes (the batch per process keeps the global batch)."""
    batch = GLOBAL_BATCH // (processes * case.accumulate)
    target = "OracleLoaders" if case.kind in LOADER_KINDS else "OracleData"
    args = ["experiment=oracle", f"data._target_=exactness_data.{target}", f"data.kind={case.kind}",
            f"data.batch_size={batch}", f"data.num_workers={case.workers}",
            f"trainer.accumulate_grad_batches={case.accumulate}", f"model.batchnorm={case.batchnorm}"]
    if processes > 1:  # workers forked from this test process's forkserver (the default): torch imported once
        args += ["strategy=ddp", f"trainer.devices={processes}", f"strategy.sync_batchnorm={case.batchnorm}"]
    if signal and case.stop_at:
        args += [f"+model.signal_at={case.stop_at * case.accumulate}", f"+model.signal_rank={case.stop_rank}"]
    return args


def fit(args: list[str], run_dir: Path) -> dict:
    return runner.fit(runner.compose(args, config_dir=CONF), run_dir=run_dir)


def run_case(case: Case, run_dir: Path) -> None:
    """Train `case` to the end in `run_dir`: straight, or stopped by SIGTERM and resumed there."""
    if not case.stop_at:
        fit(overrides(case, case.processes), run_dir)
        return
    try:
        stopped = fit(overrides(case, case.processes), run_dir)
        assert stopped.get("stop_signal"), f"no stop after the signal at step {case.stop_at}: {stopped}"
    except JobStopped as error:
        assert "resume with trainer.ckpt_path=" in str(error), error
    fit([*overrides(case, case.resume_on, signal=False), "trainer.ckpt_path=last"], run_dir)


_REFERENCES: dict[tuple, Path] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The one-process run a case must equal, trained once per data kind, accumulation and batch norm."""

    def get(case: Case) -> Path:
        key = (case.kind, case.accumulate, case.batchnorm)
        if key not in _REFERENCES:
            folder = tmp_path_factory.mktemp("reference")
            fit(overrides(Case(case.kind, accumulate=case.accumulate, batchnorm=case.batchnorm), 1), folder)
            _REFERENCES[key] = folder
        return _REFERENCES[key]

    yield get
    _REFERENCES.clear()


def _rows(run_dir: Path) -> dict[int, dict[str, float]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(row["step"]): {k: float(v) for k, v in row.items() if v != "" and k != "step"}
                for row in csv.DictReader(f)}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(1.0, abs(b))


def assert_same(run_dir: Path, reference: Path, stop_at: int = 0) -> None:
    """The run's final weights and every number it logged (metrics.csv, metrics.json) are the reference's."""
    mine = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    theirs = torch.load(reference / "checkpoints" / "last.ckpt", weights_only=True)
    assert (mine["step"], mine["epoch"]) == (theirs["step"], theirs["epoch"])
    for name, weight in theirs["model"].items():
        difference = (mine["model"][name] - weight).abs().max().item() if weight.numel() else 0.0
        assert difference <= TOLERANCE, f"{name} differs by {difference:.3g}"
    rows, expected = _rows(run_dir), _rows(reference)
    # A stopped run logs its last steps' window where it stopped (the signal's step or, agreed over processes, one
    # of the next MAX_INTERVAL + 1: runner.loop.stop); the resume carries the window on from there.
    extra = set(rows) - set(expected)
    assert len(extra) <= 1 and extra <= set(range(stop_at, stop_at + MAX_INTERVAL + 2)), (
        f"logged at steps {sorted(rows)}, expected {sorted(expected)}")
    for step, values in expected.items():
        assert step in rows, f"nothing logged at step {step}"
        for name, value in values.items():
            if not name.startswith(_TIMED):
                assert name in rows[step] and _close(rows[step][name], value), (
                    f"step {step} {name}: {rows[step].get(name)} vs the reference's {value}")
    final, reference_final = (json.loads((d / "metrics.json").read_text()) for d in (run_dir, reference))
    for name, value in reference_final.items():
        if isinstance(value, float) and not name.startswith(_TIMED) and math.isfinite(value):
            assert _close(final[name], value), f"metrics.json {name}: {final[name]} vs the reference's {value}"


def drawn_cases(count: int, seed: int) -> list[Case]:
    """`count` valid combinations drawn from `seed`: every data kind first, then any."""
    rng = random.Random(seed)
    kinds = [*KINDS, *(rng.choice(KINDS) for _ in range(max(0, count - len(KINDS))))][:count]
    cases = []
    for kind in kinds:
        processes, accumulate = rng.choice((1, 2, 3)), rng.choice((1, 2))
        case = Case(kind, processes, rng.choice((0, 2)), accumulate, batchnorm=rng.random() < 0.3)
        if rng.random() < 0.6:
            stop_at = rng.randrange(1, STEPS - 2)  # the first steps vote every step: a stop within two steps
            case = replace(case, stop_at=stop_at, stop_rank=rng.randrange(processes),
                           resume_on=rng.choice((1, 2, 3)))
        cases.append(case)
    return cases


def _run_against_reference(case: Case, tmp_path: Path, reference: Any) -> None:
    if case.kind == "hf":
        pytest.importorskip("datasets")
    run_case(case, tmp_path / "run")
    assert_same(tmp_path / "run", reference(case), stop_at=case.stop_at)


# The edges that once went wrong, always run; then the draws.
NAMED = [
    Case("hf", 2, stop_at=5, stop_rank=1, resume_on=2),  # HF's own position, resumed on 2 processes
    Case("hf", 1, workers=2),  # HF splits itself over loader workers: read in the process instead
    Case("stream_len", 3),  # 13 validation samples over 3 processes: a partial last global batch
    Case("stream_state", 2, workers=2, stop_at=6, stop_rank=0, resume_on=1),
    Case("worker_split", 1, workers=2),  # torch's recipe for splitting a stream over loader workers: read whole
]


@pytest.mark.slow
@pytest.mark.parametrize("case", [*NAMED, *drawn_cases(ORACLE_DRAWS, ORACLE_SEED)], ids=str)
def test_every_drawn_combination_trains_what_one_process_trains(case: Case, tmp_path: Path, reference: Any) -> None:
    _run_against_reference(case, tmp_path, reference)


def test_a_validation_cut_by_a_stop_signal_runs_again_first_on_resume(tmp_path: Path, reference: Any) -> None:
    """SIGTERM in the first validation (step 4, after its first batch): the run stops at step 4 unvalidated, and the
    resumed run validates step 4 before its next step, as the reference did."""
    stopped = fit([*overrides(Case(), 1), "+model.val_signal_at=1"], tmp_path / "run")
    assert stopped.get("stop_signal") == signal.SIGTERM and stopped["step"] == 4, stopped
    fit([*overrides(Case(), 1, signal=False), "trainer.ckpt_path=last"], tmp_path / "run")
    assert_same(tmp_path / "run", reference(Case()), stop_at=4)


@pytest.mark.slow
def test_a_stop_once_the_votes_are_steps_apart_stops_every_process_at_one_step(tmp_path: Path) -> None:
    """Past their first steps the processes vote every few steps (runner.loop.stop): a SIGTERM on rank 1 then still
    stops both at one step, at most MAX_INTERVAL + 1 later, saved, and the resumed run is the one-process run."""
    longer, signal_at = ["trainer.max_steps=40"], PROBE_STEPS + 8
    fit([*overrides(Case(), 1), *longer], tmp_path / "reference")
    case = Case(processes=2, stop_at=signal_at, stop_rank=1, resume_on=2)
    stopped = fit([*overrides(case, 2), *longer], tmp_path / "run")
    assert stopped.get("stop_signal") == signal.SIGTERM, stopped
    assert signal_at <= stopped["step"] <= signal_at + MAX_INTERVAL + 1
    fit([*overrides(case, 2, signal=False), *longer, "trainer.ckpt_path=last"], tmp_path / "run")
    assert_same(tmp_path / "run", tmp_path / "reference", stop_at=signal_at)


@pytest.mark.nightly
@pytest.mark.parametrize("case", drawn_cases(NIGHTLY_DRAWS, int(os.environ.get("RUNNER_ORACLE_SEED", "101"))),
                         ids=str)
def test_nightly_draws(case: Case, tmp_path: Path, reference: Any) -> None:
    _run_against_reference(case, tmp_path, reference)


# Faulty data: (case, extra overrides, what the one line says).
FAULTS = [
    (Case("one_pass"), ["trainer.max_steps=20"], r"yielded no batch in epoch 1 \(the run had taken 8 optimizer"),
    (Case("lying_len"), [], r"says len\(\) = 1000 samples but yielded 96 in epoch 0"),
    (Case("long_stream"), [], r"says len\(\) = 50 samples but yielded more in epoch 0"),
    (Case("rank_short", 2), [], r"streams end at different points: in epoch 0, after 6 optimizer steps, rank\(s\) 1"),
    (Case("object_state"), [], r"ObjectStateStream\)\.state_dict\(\) holds builtins\.object \(at data_state\.stream"),
    (Case("raising_state"), [], r"^data\.train_dataset \(ObjectStateStream\)\.state_dict\(\) raised ValueError: no "
                                r"position yet$"),
    (Case("short_sampler"), [], r"sampler CountedSampler says len\(\) = 512 but yielded 10 indices in epoch 0"),
    (Case("endless_sampler"), [], r"sampler CountedSampler says len\(\) = 96 but yielded more indices"),
    (Case("endless_val"), ["trainer.limit_val_batches=1.0"],
     r"trainer\.limit_val_batches=1\.0: data\.val_dataset \(_Endless\) is a stream without len\(\)"),
]


@pytest.mark.parametrize(("case", "extra", "said"), FAULTS, ids=[str(case) for case, _, _ in FAULTS])
def test_faulty_data_is_refused_in_one_line(case: Case, extra: list[str], said: str, tmp_path: Path) -> None:
    with pytest.raises(Exception) as raised:
        fit([*overrides(case, case.processes), *extra], tmp_path / "run")
    error = raised.value
    lines = error.problems if isinstance(error, ConfigError) else str(error).strip().splitlines()
    assert len(lines) == 1, f"{type(error).__name__} in {len(lines)} lines: {error}"
    assert is_user_error(error), repr(error)
    assert re.search(said, lines[0]), lines[0]


def test_a_stop_signal_while_the_data_keeps_the_process_waiting_ends_the_wait(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream sends SIGTERM after 40 samples (3 steps and 4 samples), then waits for data that never comes: the
    read is cut, and the run stops saved at its last step, its data's position alone kept (a resume replays)."""
    monkeypatch.setattr(runner.worker, "READ_WAIT_S", 0.5)
    result = fit(overrides(Case("blocks"), 1), tmp_path / "run")
    assert result["stop_signal"] == signal.SIGTERM and result["step"] == 3, result
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (saved["step"], saved["samples_in_epoch"], saved["data_state"]) == (3, 36, {})
    assert "the read is cut" in (tmp_path / "run" / "runner.log").read_text()
