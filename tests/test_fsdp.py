"""strategy=fsdp on 2 gloo processes: the same weights as DDP, sharded checkpoints that resume on another number
of processes and under other strategies, that survive a kill mid-save, and that export to a plain state_dict."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import runner
from _dist import run_ranks
from conftest import TINY, compose_config
from runner.checkpoint_io import sharded
from runner.config import ConfigError
from runner.export import main as export_main
from runner.models import MLP

# slow: whole runs of 2 (and 4) processes; one test process runs the module's straight runs (`runs`) for all.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp")]

# 256 samples / global batch 32: 8 steps an epoch, so the stop at step 6 falls mid-epoch.
BASE = (*[o for o in TINY if not o.startswith(("logger.", "strategy=", "trainer.devices", "data.batch_size"))],
        "logger=none", "optimizer=adamw", "trainer.max_steps=12", "trainer.ckpt_every_n_steps=6")
TWO = ("trainer.devices=2", "data.batch_size=16")


def fit(run_dir: Path, *overrides: str) -> dict:
    return runner.fit(compose_config([*BASE, *overrides]), run_dir=run_dir)


def read(path: Path) -> dict:
    """A checkpoint of any layout, as one process sees it whole."""
    return sharded.read(path) if path.is_dir() else torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert (a["step"], a["epoch"], a["samples_in_epoch"]) == (b["step"], b["epoch"], b["samples_in_epoch"])
    assert a["model"].keys() == b["model"].keys()
    for key, tensor in b["model"].items():
        torch.testing.assert_close(a["model"][key], tensor, rtol=0, atol=atol, msg=f"model.{key} differs")
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for index, state in b["optimizer"]["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(a["optimizer"]["state"][index][name], value, rtol=0, atol=atol,
                                       msg=f"optimizer state {index}.{name} differs")


@pytest.fixture(scope="session")  # built once per test process, wherever its tests land in it
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The straight runs: FSDP and DDP on 2 processes, 12 steps each, checkpoints at 6 and 12."""
    root = tmp_path_factory.mktemp("fsdp")
    fit(root / "fsdp", "strategy=fsdp", *TWO)
    fit(root / "ddp", "strategy=ddp", *TWO)
    return {"fsdp": root / "fsdp", "ddp": root / "ddp", "root": root}


def last(run: Path, name: str = "last.ckpt") -> Path:
    return run / "checkpoints" / name


def test_fsdp_trains_the_weights_ddp_trains_and_saves_every_ranks_shards(runs: dict[str, Path]) -> None:
    folder = last(runs["fsdp"])
    assert folder.is_dir() and sharded.is_sharded(folder)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                       "checksums.json", "state.pt"]
    assert not list(folder.parent.glob(".*tmp-*"))  # every save was renamed into place
    fsdp, ddp = read(folder), read(last(runs["ddp"]))
    assert fsdp["step"] == 12
    assert_same_state(fsdp, ddp)
    log = (runs["fsdp"] / "runner.log").read_text()
    assert "strategy=fsdp: 4 unit(s) over 2 process(es): Linear x3, then the root MLP" in log


def test_sharded_checkpoint_resumes_on_one_process_exactly(runs: dict[str, Path], tmp_path: Path) -> None:
    step6 = last(runs["fsdp"], "step-000006.ckpt")
    metrics = fit(tmp_path, "strategy=single", "trainer.devices=1", "data.batch_size=32", f"trainer.ckpt_path={step6}")
    assert metrics["step"] == 12
    assert_same_state(read(last(tmp_path)), read(last(runs["fsdp"])))


def test_sharded_checkpoint_resumes_under_ddp_exactly(runs: dict[str, Path], tmp_path: Path) -> None:
    step6 = last(runs["fsdp"], "step-000006.ckpt")
    fit(tmp_path, "strategy=ddp", *TWO, f"trainer.ckpt_path={step6}")
    assert_same_state(read(last(tmp_path)), read(last(runs["fsdp"])))


def test_sharded_checkpoint_of_two_processes_resumes_on_four_fsdp_processes(runs: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    step6 = last(runs["fsdp"], "step-000006.ckpt")
    fit(tmp_path, "strategy=fsdp", "trainer.devices=4", "data.batch_size=8", f"trainer.ckpt_path={step6}")
    assert sorted(p.name for p in last(tmp_path).iterdir() if p.suffix == ".distcp") == [
        f"__{rank}_0.distcp" for rank in range(4)]
    assert_same_state(read(last(tmp_path)), read(last(runs["fsdp"])))


def test_ddp_checkpoint_resumes_under_fsdp_with_accumulation_offload_and_a_full_file(runs: dict[str, Path],
                                                                                     tmp_path: Path) -> None:
    # The same global batch of 32 as 2 x 8 x accumulate 2: the micro-steps skip the reduce-scatter.
    step6 = last(runs["ddp"], "step-000006.ckpt")
    fit(tmp_path, "strategy=fsdp", "trainer.devices=2", "data.batch_size=8", "trainer.accumulate_grad_batches=2",
        "strategy.state_dict_type=full", "strategy.cpu_offload=true", "trainer.ckpt_every_n_steps=3", "trainer.keep_last_k=1",
        f"trainer.ckpt_path={step6}")
    assert last(tmp_path).is_file()  # one file, loadable without the runner
    assert sorted(p.name for p in last(tmp_path).parent.iterdir()) == ["last.ckpt", "step-000012.ckpt"]
    assert_same_state(torch.load(last(tmp_path), weights_only=True), read(last(runs["ddp"])))


def test_export_gives_a_state_dict_the_plain_model_loads(runs: dict[str, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "weights.pt"
    assert export_main([str(runs["fsdp"]), str(target)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {target}") and "6 tensors" in out
    model = MLP(in_features=8, hidden=16, num_classes=4)
    model.load_state_dict(torch.load(target, weights_only=True))  # strict: every key, every shape
    for key, tensor in read(last(runs["fsdp"]))["model"].items():
        assert torch.equal(model.state_dict()[key], tensor)
    assert export_main([str(tmp_path / "nothing"), str(tmp_path / "w.pt")]) == 1
    assert f"error: checkpoint not found: {tmp_path / 'nothing'}" in capsys.readouterr().err
    # Bare weights never replace a training checkpoint: the one exported, or another.
    assert export_main([str(runs["fsdp"]), str(last(runs["fsdp"]) / "state.pt")]) == 1
    assert "is the checkpoint being exported" in capsys.readouterr().err
    kept = last(runs["ddp"]).read_bytes()
    assert export_main([str(runs["fsdp"]), str(last(runs["ddp"]))]) == 1
    assert "is a training checkpoint (step 12)" in capsys.readouterr().err
    assert last(runs["ddp"]).read_bytes() == kept


def test_a_truncated_shard_is_named_in_one_line(runs: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    damaged = tmp_path / "last.ckpt"
    shutil.copytree(last(runs["fsdp"]), damaged)
    shard = damaged / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    message = f"cannot load sharded checkpoint {damaged}: __0_0.distcp does not match the checksum written with it"
    assert export_main([str(damaged), str(tmp_path / "w.pt")]) == 1
    assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match=re.escape(message)):  # resumed whole, on one process: before it starts
        fit(tmp_path / "run", "trainer.max_steps=14", f"trainer.ckpt_path={damaged}", "data.batch_size=32")
    # Without its checksums (trusted), the sizes: a tensor of the truncated half declares more than is there.
    (damaged / "checksums.json").unlink()
    assert export_main([str(damaged), str(tmp_path / "w.pt"), "--trust-unchecked"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert re.fullmatch(rf"error: cannot load sharded checkpoint {re.escape(str(damaged))}: its \.metadata declares "
                        r"\S+ as (scalar|[\d x]+) float32 \([\d.]+ \w+\), but its shard files hold [\d.]+ \w+ of it \(a shard "
                        r"file is truncated, or the metadata was damaged or edited\); refused before allocating it; use "
                        r"an earlier checkpoint", line), line


def test_bf16_mixed_activation_checkpointing_async_saves_and_best_checkpoints(runs: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    metrics = fit(tmp_path, "strategy=fsdp", *TWO, "precision=bf16-mixed", "strategy.shard=[Linear]",
                  "strategy.reshard_after_forward=false",
                  "strategy.activation_checkpointing=[Linear]", "checkpoint_io=async",
                  "callbacks=model_checkpoint", "trainer.val_check_interval=6", "data.test_samples=64")
    assert metrics["step"] == 12 and metrics["tested"] == str(last(tmp_path, "best.ckpt"))
    assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("train/loss", "val/loss", "test/loss"))
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "best-step-000012.ckpt", "best.ckpt", "last.ckpt", "step-000006.ckpt", "step-000012.ckpt"]  # best of 6: gone
    assert all(sharded.is_sharded(p) for p in folder.iterdir())
    log = (tmp_path / "runner.log").read_text()
    assert "activation checkpointing: 3 module(s)" in log
    state, fp32 = read(last(tmp_path)), read(last(runs["fsdp"]))
    assert state["step"] == 12 and state["model"]["net.0.weight"].dtype == torch.float32
    # bfloat16 compute moves the weights off the float32 run's, but not far.
    difference = (state["model"]["net.0.weight"] - fp32["model"]["net.0.weight"]).abs().max().item()
    assert 0 < difference < 0.05


# -- the strategy itself, in two spawned ranks -----------------------------------------------------------

class Wrapper(nn.Module):
    """What the loop hands a strategy: a module holding the user's model as `model`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = MLP(in_features=4, hidden=8, depth=2, num_classes=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def _strategy(**options: Any) -> Any:
    from runner.environments import LocalEnvironment
    from runner.strategies import FSDPStrategy

    strategy = FSDPStrategy(parallel_devices=[torch.device("cpu")] * 2, cluster_environment=LocalEnvironment(),
                            timeout=30, **options)
    strategy.setup_environment()
    return strategy


def _accumulation(strategy: Any, wrapped: nn.Module, rank: int) -> dict[str, Any]:
    """Two micro-batches: no gradient exists after the first (nothing reduce-scattered); after the second the
    shards hold the mean over both ranks of both micro-batches' sums, as one plain model computes it."""
    import torch.distributed as dist

    torch.manual_seed(0)
    plain = MLP(in_features=4, hidden=8, depth=2, num_classes=2)
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * r + m)) for r in range(2)
               for m in range(2)]
    mine = batches[2 * rank: 2 * rank + 2]
    with strategy.backward_sync(wrapped, enabled=False):
        wrapped(mine[0]).pow(2).sum().backward()
    skipped = all(p.grad is None for p in wrapped.parameters())
    with strategy.backward_sync(wrapped, enabled=True):
        wrapped(mine[1]).pow(2).sum().backward()
    for batch in batches:
        plain(batch).pow(2).sum().backward()
    expected = [p.grad / 2 for p in plain.parameters()]
    got = [p.grad.full_tensor() for p in wrapped.parameters()]
    dist.barrier()
    return {"skipped": skipped, "mean": all(torch.allclose(g, e, atol=1e-5) for g, e in zip(got, expected)),
            "local_rows": wrapped.model.net[0].weight.to_local().shape[0]}


def kill_during_save_scenario(rank: int, folder: str) -> None:
    """Sharding and accumulation checks, then a checkpoint at step 1, then both ranks killed while writing step 2."""
    from torch.distributed.checkpoint import FileSystemWriter

    strategy = _strategy(activation_checkpointing=["ReLU"])
    torch.manual_seed(0)
    wrapped = strategy.setup_module(Wrapper())
    out = _accumulation(strategy, wrapped, rank)
    out["checkpoint_wrapped"] = sum(type(m).__name__ == "CheckpointWrapper" for m in wrapped.modules())
    optimizer = torch.optim.SGD(wrapped.model.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()
    path = Path(folder) / "last.ckpt"

    def state(step: int) -> dict:
        return {"model": wrapped.model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}

    strategy.save_checkpoint(state(1), path)
    out["saved_weights"] = {k: v.full_tensor() for k, v in wrapped.model.state_dict().items()}
    torch.save(out, Path(folder) / f"rank{rank}.pt")
    write_data = FileSystemWriter.write_data

    def die_after_writing(self: Any, plan: Any, planner: Any) -> Any:
        write_data(self, plan, planner).wait()  # this rank's shard is on disk; the metadata is not
        os._exit(9)

    FileSystemWriter.write_data = die_after_writing
    optimizer.step()
    strategy.save_checkpoint(state(2), path)


def test_fsdp_strategy_shards_skips_sync_on_micro_steps_and_survives_a_kill_during_save(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="died with exit code 9"):
        run_ranks(kill_during_save_scenario, world_size=2, args=(str(tmp_path),), timeout=60)
    for rank in (0, 1):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert out["skipped"] and out["mean"], out
        assert out["local_rows"] == 4  # half of the first layer's 8 rows on each rank
        assert out["checkpoint_wrapped"] == 2  # the two ReLUs
    previous = sharded.read(tmp_path / "last.ckpt")
    assert previous["step"] == 1
    for key, tensor in out["saved_weights"].items():  # the weights of step 1, not a mix with step 2's
        assert torch.equal(previous["model"][key], tensor), key
    assert previous["model"]["net.0.weight"].shape == (8, 4)  # whole again: both ranks' halves
    assert previous["optimizer"]["state"][0]["momentum_buffer"].shape == (8, 4)
    (partial,) = tmp_path.glob(".last.ckpt.tmp-*")  # what the killed save left: shards, no metadata
    assert {p.name for p in partial.iterdir()} >= {"__0_0.distcp", "__1_0.distcp"}
    assert not (partial / ".metadata").exists()
    again = sharded.temporary_path(tmp_path / "last.ckpt", "next")  # the next save of it clears the leftover
    shutil.copytree(tmp_path / "last.ckpt", again)
    sharded.publish(again, tmp_path / "last.ckpt")
    assert not partial.exists() and sharded.read(tmp_path / "last.ckpt")["step"] == 1
