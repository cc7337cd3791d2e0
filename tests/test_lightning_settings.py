"""A LightningModule under the settings a Lightning project turns on: strategy=fsdp on 2 gloo processes, bf16-mixed
precision on CPU, torch.compile in its setup(), gradient accumulation. Each run is compared with a reference run's
numbers (weights, logged metrics), not only with its exit code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config, load_checkpoint, run_main

import runner
from runner.checkpoint_io import sharded

TESTS = Path(__file__).resolve().parent
# 256 samples, a global batch of 16: 16 steps an epoch; 12 steps end mid-epoch, before the end-of-epoch validation.
LIT = ("model._target_=lightning_settings_modules.LitSettings", "model.in_features=8", "model.num_classes=4",
       "logger=none", "trainer.max_steps=12", "trainer.log_every_n_steps=4")


@pytest.fixture(autouse=True)
def _workers_import_the_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def fit(run_dir: Path, *overrides: str) -> dict:
    base = [o for o in TINY if not o.startswith("logger.")]
    return runner.fit(compose_config([*base, *LIT, *overrides]), run_dir=run_dir)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The saved module's tensors by name, whatever the checkpoint's layout (a file, or FSDP's sharded folder)."""
    path = run_dir / "checkpoints" / "last.ckpt"
    state = sharded.read(path) if path.is_dir() else load_checkpoint(run_dir)
    return state["model"]


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=0, atol=atol, msg=f"model.{name} differs")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One process, batch 16, float32, eager: the run every setting is compared with."""
    run_dir = tmp_path_factory.mktemp("reference")
    return run_dir, fit(run_dir)


@pytest.mark.slow
@pytest.mark.xdist_group("lightning_fsdp")
def test_fsdp_on_two_processes_trains_what_one_process_trains(reference: tuple[Path, dict], tmp_path: Path) -> None:
    """strategy=fsdp, 2 gloo processes x 8: the module's steps run inside FSDP's sharded root; the gathered weights
    and the logged metrics are those of 1 process x 16."""
    ref_dir, ref = reference
    two = fit(tmp_path, "strategy=fsdp", "trainer.devices=2", "data.batch_size=8")
    assert two["step"] == ref["step"] == 12
    assert_same_weights(weights(ref_dir), weights(tmp_path), atol=1e-5)
    assert (ref["train/world"], two["train/world"]) == (1.0, 2.0)
    for key in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert two[key] == pytest.approx(ref[key], abs=1e-5), key


def test_bf16_mixed_on_cpu_runs_the_steps_under_autocast(reference: tuple[Path, dict], tmp_path: Path) -> None:
    """precision=bf16-mixed on CPU: the module's forward gives bfloat16 logits (float32 ones under 32-true), the
    weights stay float32, and training follows the float32 run to bfloat16's precision without equalling it."""
    ref_dir, ref = reference
    mixed = fit(tmp_path, "precision=bf16-mixed")
    assert (ref["train/low_precision"], mixed["train/low_precision"]) == (0.0, 1.0)
    a, b = weights(ref_dir), weights(tmp_path)
    assert {t.dtype for t in b.values() if t.is_floating_point()} == {torch.float32}
    assert_same_weights(a, b, atol=2e-2)
    assert any(not torch.equal(a[name], b[name]) for name in a)
    assert mixed["val/loss"] == pytest.approx(ref["val/loss"], abs=1e-2)


def test_torch_compile_in_setup_trains_what_eager_trains(reference: tuple[Path, dict], tmp_path: Path) -> None:
    """torch.compile(self.net) in setup("fit"), as lightning-hydra-template does (dynamo's eager backend: the
    wrapping and the graph capture without a C compiler): the steps call the compiled net, and the weights and
    metrics are the eager run's. The checkpoint holds the compiled net's names (`net._orig_mod.*`), as Lightning's
    would, since the module's own state_dict has them."""
    ref_dir, ref = reference
    compiled = fit(tmp_path, "+model.compile=eager")
    assert (ref["train/compiled"], compiled["train/compiled"]) == (0.0, 1.0)
    saved = {name.replace("._orig_mod", ""): value for name, value in weights(tmp_path).items()}
    assert_same_weights(weights(ref_dir), saved, atol=1e-6)
    for key in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert compiled[key] == pytest.approx(ref[key], abs=1e-6), key


def test_accumulating_two_batches_of_8_trains_what_one_batch_of_16_trains(reference: tuple[Path, dict],
                                                                          tmp_path: Path) -> None:
    """trainer.accumulate_grad_batches=2 with data.batch_size=8: 12 optimizer steps over the same 16 samples each,
    so the same weights and window metrics as batch 16 (the module's mean losses weighted by their 8 samples)."""
    ref_dir, ref = reference
    accumulated = fit(tmp_path, "trainer.accumulate_grad_batches=2", "data.batch_size=8")
    assert accumulated["step"] == ref["step"] == 12
    assert_same_weights(weights(ref_dir), weights(tmp_path), atol=1e-6)
    for key in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert accumulated[key] == pytest.approx(ref[key], abs=1e-6), key



def resumed_at_6(tmp_path: Path, *overrides: str) -> Path:
    """6 steps, then a new run from that one's last.ckpt to step 12; the resumed run's folder."""
    fit(tmp_path / "first", *overrides, "trainer.max_steps=6")
    fit(tmp_path / "resumed", *overrides, f"trainer.ckpt_path={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}")
    return tmp_path / "resumed"


def test_a_lightning_module_with_sgd_resumes_to_the_straight_runs_weights(reference: tuple[Path, dict],
                                                                           tmp_path: Path) -> None:
    assert_same_weights(weights(reference[0]), weights(resumed_at_6(tmp_path)), atol=1e-6)


def test_torch_compile_in_setup_resumes(tmp_path: Path) -> None:
    compiled = ("+model.compile=eager", "+model.optimizer=adam")  # Adam: the optimizer check passes (see above)
    fit(tmp_path / "straight", *compiled)
    assert_same_weights(weights(tmp_path / "straight"), weights(resumed_at_6(tmp_path, *compiled)), atol=1e-6)



@pytest.mark.slow
@pytest.mark.xdist_group("lightning_fsdp")
def test_fsdp_resumes_from_its_sharded_checkpoint_to_one_processs_weights(tmp_path: Path) -> None:
    """strategy=fsdp on 2 processes, 6 steps, then resumed from the sharded last.ckpt to 12: the weights 1 process
    trains straight (Adam, whose state names the optimizer check accepts, see above)."""
    adam = ("+model.optimizer=adam",)
    fit(tmp_path / "one", *adam)
    resumed = resumed_at_6(tmp_path / "fsdp", "strategy=fsdp", "trainer.devices=2", "data.batch_size=8", *adam)
    assert (resumed / "checkpoints" / "last.ckpt").is_dir()  # sharded: each process wrote its shards
    assert_same_weights(weights(tmp_path / "one"), weights(resumed), atol=1e-5)


# What Lightning 2.6's Trainer(accumulate_grad_batches=2, max_steps=2) calls, in this order (its automatic
# optimization loop: each micro-batch's on_train_batch_end right after its backward pass; the optimizer step inside
# the last one's, so that one sees the new global_step).
LIGHTNING_ORDER = [line for step in (0, 1) for line in (
    f"on_train_batch_start idx={2 * step} gs={step}", f"training_step idx={2 * step} gs={step}",
    f"on_train_batch_end idx={2 * step} gs={step}",
    f"on_train_batch_start idx={2 * step + 1} gs={step}", f"training_step idx={2 * step + 1} gs={step}",
    f"on_before_optimizer_step gs={step}", f"on_train_batch_end idx={2 * step + 1} gs={step + 1}")]


def test_batch_hooks_under_accumulation_come_in_lightnings_order(tmp_path: Path) -> None:
    fit(tmp_path / "run", "model._target_=lightning_settings_modules.LitHookOrder", f"+model.record={tmp_path}",
        "trainer.accumulate_grad_batches=2", "data.batch_size=8", "trainer.max_steps=2")
    assert (tmp_path / "hooks").read_text().splitlines() == LIGHTNING_ORDER


def test_lightnings_trainer_precision_key_is_one_line_naming_the_precision_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    base = [o for o in TINY if not o.startswith("logger.")]
    code, out = run_main([*base, *LIT, "trainer.precision=bf16-mixed", f"hydra.run.dir={tmp_path}"], monkeypatch,
                         capsys)
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 1
    assert len(lines) == 1 and "precision=<option>" in lines[0] and "bf16-mixed" in lines[0], lines
