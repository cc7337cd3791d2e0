"""A rank that hangs before its first step (in prepare_data, in setup, in its first forward) is named, with the
phase, within strategy.stall_timeout, not after strategy.timeout: the ranks that wait for it in a collective are
not blamed. Real processes (2 gloo workers), real hangs (faulty_more's fixtures)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from faulty_more import HangFirstForward
from test_reliability import DDP2, TINY, processes_mentioning, start, wait_for

STALL_S = 8
# Start-up (importing torch on 2 busy cores), the watch's stack dumps (up to 5 s) and the kill; far below the
# 30 minutes of strategy.timeout the hang used to last.
MARGIN_S = 60


class HangFirstStep(HangFirstForward):
    """HangFirstForward past the data checks (a forward without gradients, on the CPU or the meta device) and the
    FLOP count (on the meta device): it hangs in the first step itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trial = x.device.type == "meta" or not torch.is_grad_enabled()
        return self.linear(x) if trial else super().forward(x)


@pytest.mark.parametrize(("fault", "rank", "where"), [
    (("data._target_=faulty_more.Hooks", "+data.hook=prepare_data", "+data.what=hang", "+data.rank=0"), 0,
     "in data.prepare_data()"),
    (("data._target_=faulty_more.Hooks", "+data.hook=setup", "+data.what=hang", "+data.rank=1"), 1,
     "in data.setup('fit')"),
    (("model._target_=test_stall_before_first_step.HangFirstStep", "+model.rank=1"), 1, "in its first step (step 1)"),
    (("+callbacks.quiet._target_=hang_at_import.Quiet",), 1, "in the import of the modules its config names"),
], ids=["prepare_data-rank0", "setup-rank1", "first-forward-rank1", "import-rank1"])
def test_a_rank_hung_before_its_first_step_is_named_with_its_phase(tmp_path: Path, fault: tuple, rank: int,
                                                                   where: str) -> None:
    run_dir = tmp_path / "run"
    began = time.monotonic()
    job = start(run_dir, *DDP2, *TINY, *fault, f"strategy.stall_timeout={STALL_S}", cwd=tmp_path)
    try:
        _, stderr = job.communicate(timeout=STALL_S + MARGIN_S + 60)
    finally:
        job.kill()
    elapsed = time.monotonic() - began
    assert job.returncode == 1, stderr
    said = f"error: rank {rank} made no progress for "
    assert said in stderr and f" s {where}, while the other ranks waited for it (strategy.stall_timeout={STALL_S})" \
        in stderr, stderr
    assert "; if it is only slow (a download, compiling), raise strategy.stall_timeout." in stderr, stderr
    fixture = "hang_at_import.py" if "import" in where else "faulty_more.py"
    assert "time.sleep" in stderr or fixture in stderr, stderr  # the hung rank's own frames
    assert "Traceback" not in stderr, stderr  # no gloo timeout blaming the rank that waited
    log = run_dir / ("runner.log" if rank == 0 else f"rank_{rank}.log")
    assert fixture in log.read_text()  # its whole stack is kept in its log
    assert elapsed < STALL_S + MARGIN_S, elapsed
    assert wait_for(lambda: not processes_mentioning(str(run_dir)), 10)
