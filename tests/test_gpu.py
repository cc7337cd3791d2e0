"""GPU paths: DataParallel, DDP over nccl, mixed and half precision, pinned memory, FSDP, async checkpoints,
compile, and the fast path (fused AdamW, TF32) with the FLOP rate and MFU it logs.

Run on a GPU machine with `pytest -m cuda`; without CUDA every test here is skipped. Most runs are in-process
(`runner.fit`): a process start costs seconds there; DDP and the loader's worker processes go through the CLI.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import runner
from conftest import compose_config, load_checkpoint
from runner.flops import peak_tflops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TINY = ["data.num_samples=2048", "data.val_samples=300", "trainer.max_steps=20", "trainer.log_every_n_steps=5"]
CUDA = ["accelerator=cuda", "trainer.devices=1", "cluster=local", *TINY]


def run(tmp_path: Path, *args: str) -> dict:
    """`python -m runner` with TINY, then the test's own overrides (the later value of a key wins)."""
    result = subprocess.run([sys.executable, "-m", "runner", *TINY, *args, f"hydra.run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads((tmp_path / "metrics.json").read_text())


def fit(run_dir: Path, *overrides: str) -> dict:
    """The same job in this process, on one GPU: CUDA, then the test's own overrides."""
    return runner.fit(compose_config([*CUDA, *overrides]), run_dir=run_dir)


def test_dataparallel_over_all_gpus(tmp_path: Path) -> None:
    metrics = fit(tmp_path, "strategy=dp", "trainer.devices=-1")
    assert metrics["step"] == 20 and metrics["val/loss"] > 0


def test_ddp_with_nccl(tmp_path: Path) -> None:
    devices = min(2, torch.cuda.device_count())
    run(tmp_path, "strategy=ddp", "accelerator=cuda", f"trainer.devices={devices}")
    assert (tmp_path / "metrics.json").exists()
    assert devices == 1 or (tmp_path / "rank_1.log").exists()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true", "16-true"])
def test_precision_on_cuda(tmp_path: Path, precision: str) -> None:
    # float16 weights cannot hold AdamW's default eps=1e-8 (it rounds to 0): the runner refuses it for 16-true.
    eps = ["+optimizer.eps=1e-4"] if precision == "16-true" else []
    metrics = fit(tmp_path, f"precision={precision}", *eps)
    assert metrics["val/loss"] == metrics["val/loss"] and metrics["step"] == 20  # not NaN


def test_16_mixed_scaler_state_is_saved_and_restored(tmp_path: Path) -> None:
    first = tmp_path / "first"
    fit(first, "precision=16-mixed")
    checkpoint = load_checkpoint(first)
    assert checkpoint["precision"]["scale"] > 0
    metrics = fit(tmp_path / "second", "precision=16-mixed", "trainer.max_steps=30",
                  f"trainer.ckpt_path={first / 'checkpoints' / 'last.ckpt'}")
    assert metrics["step"] == 30


def test_cuda_checkpoint_loads_on_cpu(tmp_path: Path) -> None:
    fit(tmp_path)
    assert all(t.device.type == "cpu" for t in load_checkpoint(tmp_path)["model"].values())


def test_pinned_memory_loading(tmp_path: Path) -> None:
    run(tmp_path, "accelerator=cuda", "trainer.devices=1", "data.pin_memory=true", "data.num_workers=1")


# -- the fast path and what it logs -------------------------------------------------------------------------------

def test_fused_adamw_trains_what_foreach_adamw_trains(tmp_path: Path) -> None:
    exact = ("optimizer=adamw", "precision.tf32=false")  # full float32: the optimizers' arithmetic alone differs
    fused = fit(tmp_path / "fused", *exact)
    plain = fit(tmp_path / "foreach", *exact, "+optimizer.foreach=true")
    one, other = load_checkpoint(tmp_path / "fused"), load_checkpoint(tmp_path / "foreach")
    assert one["optimizer"]["param_groups"][0]["fused"] is True
    assert not other["optimizer"]["param_groups"][0]["fused"]
    for name, tensor in other["model"].items():
        torch.testing.assert_close(one["model"][name], tensor, rtol=0, atol=1e-5)
    assert fused["val/loss"] == pytest.approx(plain["val/loss"], abs=1e-5)


def test_tf32_on_and_off_both_train(tmp_path: Path) -> None:
    for name, setting in (("on", "true"), ("off", "false")):
        metrics = fit(tmp_path / name, f"precision.tf32={setting}", "model.hidden=256")
        assert metrics["train/loss"] < 0.9 * math.log(4), metrics  # a uniform guess over data=synthetic's 4 classes
        log = (tmp_path / name / "runner.log").read_text()
        assert ("matmuls in tf32" if name == "on" else "matmuls in fp32") in log
    assert torch.backends.cuda.matmul.allow_tf32 is False  # each run put the process's setting back


def test_mfu_is_logged_against_the_gpus_peak(tmp_path: Path) -> None:
    if peak_tflops(torch.cuda.get_device_name(0), "bf16") is None:
        pytest.skip(f"{torch.cuda.get_device_name(0)} is not in runner.flops.PEAK_TFLOPS")
    metrics = fit(tmp_path, "precision=bf16-mixed", "model.hidden=512", "data.batch_size=256")
    assert 0 < metrics["throughput/mfu"] < 1
    assert metrics["throughput/tflops_per_s"] > 0


def test_charlm_bf16_mixed_learns_and_logs_its_flop_rate(tmp_path: Path) -> None:
    cfg = compose_config(["accelerator=cuda", "trainer.devices=1", "experiment=charlm", "precision=bf16-mixed",
                          "trainer.max_steps=60", "trainer.val_check_interval=60", "data.max_bytes=300000"])
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert metrics["val/loss"] < 3.5  # from 5.5 nats a byte, a uniform guess
    assert metrics["throughput/tflops_per_s"] > 0
    if peak_tflops(torch.cuda.get_device_name(0), "bf16") is not None:
        assert 0 < metrics["throughput/mfu"] < 1


def test_fsdp_on_cuda_resumes_where_it_stopped(tmp_path: Path) -> None:
    straight = fit(tmp_path / "straight", "strategy=fsdp")
    fit(tmp_path / "resumed", "strategy=fsdp", "trainer.max_steps=10")
    resumed = fit(tmp_path / "resumed", "strategy=fsdp", "trainer.ckpt_path=last")
    assert resumed["step"] == 20
    assert resumed["val/loss"] == pytest.approx(straight["val/loss"], abs=1e-5)


def test_async_checkpoints_on_cuda(tmp_path: Path) -> None:
    fit(tmp_path, "checkpoint_io=async", "trainer.ckpt_every_n_steps=5")
    steps = sorted(load_checkpoint(tmp_path, p.name)["step"] for p in (tmp_path / "checkpoints").glob("step-*.ckpt"))
    assert steps == [5, 10, 15, 20] and load_checkpoint(tmp_path)["step"] == 20


def test_compile_on_cuda_trains_what_eager_trains(tmp_path: Path) -> None:
    torch._dynamo.reset()
    exact = ("precision.tf32=false",)
    eager = fit(tmp_path / "eager", *exact)
    compiled = fit(tmp_path / "compiled", *exact, "trainer.compile=true")
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], abs=1e-4)
    assert compiled["throughput/tflops_per_s"] / compiled["throughput/samples_per_s"] == pytest.approx(
        eager["throughput/tflops_per_s"] / eager["throughput/samples_per_s"])
