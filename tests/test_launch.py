"""The launcher: what workers find in their environment, a clean parent afterwards, and a failing rank ending the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from _dist import TESTS_DIR, clean_environ, processes_mentioning, run_cli

# Run in a fresh interpreter (cwd: tests/, so workers import `faulty`): compose, snapshot os.environ, fit, compare.
FIT_SCRIPT = """
import json, os, sys
from hydra import compose, initialize_config_dir
import runner
from runner.cli import CONFIG_DIR
overrides, run_dir = json.loads(sys.argv[1]), sys.argv[2]
with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
    cfg = compose("config", overrides=overrides)
import torch
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # torch itself sets TORCHINDUCTOR_CACHE_DIR here
before = dict(os.environ)
metrics = runner.fit(cfg, run_dir)
after = dict(os.environ)
changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
print(json.dumps({"changed": changed, "step": metrics["step"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("omp, start_method, deterministic", [(None, "popen", False), ("3", "spawn", True)])
def test_worker_environment_and_parent_unchanged(tmp_path: Path, omp: Optional[str], start_method: str,
                                                 deterministic: bool) -> None:
    probes = tmp_path / "probes"
    probes.mkdir()
    overrides = ["strategy=ddp", "accelerator=cpu", "trainer.devices=2", f"strategy.start_method={start_method}",
                 "model=mlp", "model._target_=faulty.EnvProbe", f"+model.out_dir={probes}", "~model.hidden",
                 "~model.depth", "data.num_samples=64", "data.val_samples=20", "data.batch_size=16",
                 "trainer.max_steps=1", "trainer.max_epochs=-1", f"trainer.deterministic={deterministic}"]
    env = clean_environ() if omp is None else clean_environ(OMP_NUM_THREADS=omp)
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    result = subprocess.run([sys.executable, "-c", FIT_SCRIPT, json.dumps(overrides), str(tmp_path / "run")],
                            cwd=TESTS_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"changed": [], "step": 1}
    seen = [json.loads((probes / f"env_{rank}.json").read_text()) for rank in (0, 1)]
    expected_threads = omp or str(max(1, (os.cpu_count() or 1) // 2))
    for rank, worker in enumerate(seen):
        assert (worker["RANK"], worker["LOCAL_RANK"], worker["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert worker["MASTER_ADDR"] == "127.0.0.1"
        assert int(worker["MASTER_PORT"]) > 0
        assert worker["OMP_NUM_THREADS"] == expected_threads
        # Deterministic CUDA matmuls need this set before the worker first touches cuBLAS.
        assert worker["CUBLAS_WORKSPACE_CONFIG"] == (":4096:8" if deterministic else None)
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]


@pytest.mark.slow
@pytest.mark.parametrize("how, error", [("raise", "injected failure at step 3"), ("kill", "SIGKILL")])
def test_failing_rank_ends_the_job(tmp_path: Path, how: str, error: str) -> None:
    """Rank 1 fails at its third step of a run that would otherwise go on for hours."""
    run_dir = tmp_path / "run"
    args = ["strategy=ddp", "accelerator=cpu", "trainer.devices=2", "model._target_=faulty.FailOnRank1",
            f"+model.how={how}", "~model.hidden", "~model.depth", "data.num_samples=512", "data.val_samples=32",
            "data.batch_size=4", "trainer.max_epochs=100000", f"hydra.run.dir={run_dir}"]
    start = time.monotonic()
    result = run_cli(args, cwd=TESTS_DIR, timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 60
    # The job's own last word names the rank and carries its error (not only the workers' echoed tracebacks).
    assert "error: rank 1" in result.stderr, result.stderr
    assert error in result.stderr[result.stderr.index("error: rank 1"):]
    deadline = time.monotonic() + 10  # a killed worker may take a moment to be reaped
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(run_dir)) == []
    assert not (run_dir / "metrics.json").exists()
