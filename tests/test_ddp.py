"""DDPStrategy: every public method checked with known answers in two real gloo processes, plus its one-process set-up."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from _dist import restore_environ, run_ranks  # noqa: F401 - restore_environ is a fixture
from runner.environments import LocalEnvironment, SLURMEnvironment, TorchElasticEnvironment
from runner.launch import ElasticLauncher, launcher_for
from runner.strategies import DDPStrategy, SingleDeviceStrategy, auto_strategy

CPU2 = [torch.device("cpu"), torch.device("cpu")]


# -- what each of the two ranks runs -----------------------------------------------------------------

def _collectives(strategy: DDPStrategy, rank: int) -> dict[str, Any]:
    value = torch.tensor(float(rank + 1))
    out = {op: strategy.all_reduce(value, reduce_op=op).item() for op in ("mean", "sum", "max", "min")}
    out["avg"] = strategy.all_reduce(value, reduce_op="avg").item()
    out["default"] = strategy.all_reduce(value).item()
    out["torch_op"] = strategy.all_reduce(value, reduce_op=dist.ReduceOp.SUM).item()
    integer_mean = strategy.all_reduce(torch.tensor(rank + 1), reduce_op="mean")
    out["int_mean"] = (integer_mean.item(), integer_mean.is_floating_point())
    integer_sum = strategy.all_reduce(torch.tensor(rank + 1), reduce_op="sum")
    out["int_sum"] = (integer_sum.item(), integer_sum.dtype)
    out["vector_mean"] = strategy.all_reduce(torch.tensor([rank, 2.0 * rank])).tolist()
    transposed = (torch.arange(6.0).reshape(2, 3) * (rank + 1)).t()  # not contiguous
    out["transposed_sum"] = strategy.all_reduce(transposed, reduce_op="sum").tolist()
    out["reduce"] = strategy.reduce(value, reduce_op="sum").item()
    source = torch.tensor([float(rank + 1)])
    first = strategy.start_all_reduce(source, reduce_op="sum")
    second = strategy.start_all_reduce(torch.tensor(rank + 1), reduce_op="mean")
    source.fill_(100.0)  # the caller's tensor changes while its reduction is in flight
    out["started"] = (second().item(), first().tolist(), source.item())  # waited for out of order
    out["non_tensors"] = (strategy.all_reduce(rank + 1), strategy.all_reduce("text"), strategy.all_reduce(None))
    try:
        strategy.all_reduce(value, reduce_op="median")
    except ValueError as error:
        out["bad_op"] = str(error)
    return out


def _barrier_wait(strategy: DDPStrategy, rank: int) -> float:
    """How long rank 0 waits in the barrier for rank 1, which arrives 1 s late."""
    strategy.barrier()
    if rank == 1:
        time.sleep(1.0)
    start = time.monotonic()
    strategy.barrier("named")
    return time.monotonic() - start


def _decisions(strategy: DDPStrategy, rank: int) -> dict[str, bool]:
    differing = rank == 0  # rank 0 votes True, rank 1 False
    return {
        "differ_all": strategy.reduce_boolean_decision(differing, all=True),
        "differ_any": strategy.reduce_boolean_decision(differing, all=False),
        "true_all": strategy.reduce_boolean_decision(True, all=True),
        "false_any": strategy.reduce_boolean_decision(False, all=False),
    }


def _grads_of_both(module: nn.Module) -> list[torch.Tensor]:
    grad = torch.cat([p.grad.flatten() for p in module.parameters()])
    both = [torch.empty_like(grad) for _ in range(2)]
    dist.all_gather(both, grad)
    return both


def _backward_sync(strategy: DDPStrategy, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    plain = nn.Linear(3, 2)
    wrapped = strategy.setup_module(plain)
    inputs = torch.full((4, 3), float(rank + 1))  # different data per rank: different local gradients
    with strategy.backward_sync(wrapped, enabled=False):
        wrapped(inputs).pow(2).sum().backward()
    local = _grads_of_both(wrapped)
    for p in wrapped.parameters():
        p.grad = None
    with strategy.backward_sync(wrapped, enabled=True):
        wrapped(inputs).pow(2).sum().backward()
    synced = _grads_of_both(wrapped)
    return {
        "local_differ": not torch.allclose(local[0], local[1]),
        "synced_equal": torch.allclose(synced[0], synced[1]),
        "synced_is_mean": torch.allclose(synced[0], (local[0] + local[1]) / 2, atol=1e-6),
        "is_ddp": isinstance(wrapped, DistributedDataParallel),
        "bucket_view": wrapped.gradient_as_bucket_view,
        "unwrap_is_plain": strategy.unwrap(wrapped) is plain,
    }


def two_rank_scenario(rank: int) -> dict[str, Any]:
    strategy = DDPStrategy(parallel_devices=CPU2, cluster_environment=LocalEnvironment(),
                           timeout=30, gradient_as_bucket_view=True)
    strategy.setup_environment()
    strategy.setup_environment()  # a second call joins nothing new
    out: dict[str, Any] = {
        "identity": (strategy.global_rank, strategy.local_rank, strategy.node_rank, strategy.world_size,
                     strategy.is_global_zero),
        "root_device": strategy.root_device,
        "sampler": strategy.distributed_sampler_kwargs,
        "backend": dist.get_backend(),
        "collectives": _collectives(strategy, rank),
        "barrier_wait": _barrier_wait(strategy, rank),
        "broadcast": strategy.broadcast({"from": rank, "items": [rank] * 3}, src=1),
        "broadcast_default": strategy.broadcast(("rank", rank)),
        "decisions": _decisions(strategy, rank),
        "backward_sync": _backward_sync(strategy, rank),
    }
    strategy.teardown()
    out["initialized_after_teardown"] = dist.is_initialized()
    out["barrier_after_teardown"] = strategy.barrier() is None  # no group left: a no-op, not a hang
    return out


# Under pytest -n, the module's tests stay in one test process, which runs this fixture once for all.
pytestmark = pytest.mark.xdist_group("ddp")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(two_rank_scenario, world_size=2, timeout=90)


# -- two processes -----------------------------------------------------------------------------------

def test_identity_properties(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["identity"] == (0, 0, 0, 2, True)
    assert ranks[1]["identity"] == (1, 1, 0, 2, False)
    assert all(r["root_device"] == torch.device("cpu") for r in ranks)
    assert all(r["backend"] == "gloo" for r in ranks)


def test_distributed_sampler_kwargs(ranks: list[dict[str, Any]]) -> None:
    assert [r["sampler"] for r in ranks] == [{"num_replicas": 2, "rank": 0}, {"num_replicas": 2, "rank": 1}]


@pytest.mark.parametrize("rank", [0, 1])
def test_all_reduce_known_answers(ranks: list[dict[str, Any]], rank: int) -> None:
    out = ranks[rank]["collectives"]
    assert (out["mean"], out["sum"], out["max"], out["min"]) == (1.5, 3.0, 2.0, 1.0)
    assert out["avg"] == out["default"] == 1.5
    assert out["torch_op"] == 3.0
    assert out["vector_mean"] == [0.5, 1.0]
    assert out["transposed_sum"] == [[0.0, 9.0], [3.0, 12.0], [6.0, 15.0]]
    assert out["reduce"] == 3.0
    assert out["started"] == (1.5, [3.0], 100.0)


@pytest.mark.parametrize("rank", [0, 1])
def test_all_reduce_integer_mean_is_not_truncated(ranks: list[dict[str, Any]], rank: int) -> None:
    assert ranks[rank]["collectives"]["int_mean"] == (1.5, True)
    assert ranks[rank]["collectives"]["int_sum"] == (3, torch.int64)


def test_all_reduce_returns_non_tensors_unchanged(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["collectives"]["non_tensors"] == (1, "text", None)
    assert ranks[1]["collectives"]["non_tensors"] == (2, "text", None)


def test_all_reduce_unknown_op_names_the_allowed_ones(ranks: list[dict[str, Any]]) -> None:
    message = ranks[0]["collectives"]["bad_op"]
    assert "median" in message and "sum" in message and "mean" in message


def test_barrier_waits_for_the_late_rank(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["barrier_wait"] > 0.5


def test_broadcast_from_src(ranks: list[dict[str, Any]]) -> None:
    assert all(r["broadcast"] == {"from": 1, "items": [1, 1, 1]} for r in ranks)
    assert all(r["broadcast_default"] == ("rank", 0) for r in ranks)


def test_reduce_boolean_decision(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["decisions"] == {"differ_all": False, "differ_any": True, "true_all": True, "false_any": False}


def test_setup_module_wraps_in_ddp_with_extra_kwargs(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["backward_sync"]["is_ddp"] and r["backward_sync"]["unwrap_is_plain"]
        assert r["backward_sync"]["bucket_view"] is True


def test_backward_sync_disabled_skips_gradient_sync(ranks: list[dict[str, Any]]) -> None:
    assert all(r["backward_sync"]["local_differ"] for r in ranks)


def test_backward_sync_enabled_averages_gradients(ranks: list[dict[str, Any]]) -> None:
    assert all(r["backward_sync"]["synced_equal"] and r["backward_sync"]["synced_is_mean"] for r in ranks)


def test_teardown_destroys_the_group(ranks: list[dict[str, Any]]) -> None:
    assert not any(r["initialized_after_teardown"] for r in ranks)
    assert all(r["barrier_after_teardown"] for r in ranks)


# -- one process -------------------------------------------------------------------------------------

def test_one_process_group_needs_no_port(restore_environ: None) -> None:
    for key in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    strategy = DDPStrategy(cluster_environment=LocalEnvironment())
    strategy.setup_environment()
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert strategy.all_reduce(torch.tensor(3), reduce_op="mean").item() == 3.0
    assert strategy.broadcast({"a": 1}) == {"a": 1}
    assert strategy.reduce_boolean_decision(True) is True
    strategy.teardown()
    assert not dist.is_initialized()


def test_collectives_without_a_group_are_identities() -> None:
    strategy = DDPStrategy()
    assert strategy.broadcast([1, 2], src=0) == [1, 2]
    assert strategy.barrier() is None


def test_constructor_arguments() -> None:
    strategy = DDPStrategy(parallel_devices=CPU2, timeout=12, process_group_backend="gloo", start_method="spawn",
                           find_unused_parameters=True)
    assert strategy.timeout == datetime.timedelta(seconds=12)
    assert strategy.process_group_backend == "gloo"
    assert strategy.parallel_devices == CPU2
    assert isinstance(strategy.cluster_environment, LocalEnvironment)
    assert DDPStrategy().timeout == datetime.timedelta(seconds=1800)


def test_bad_start_method_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"strategy.start_method='thread'.*popen, spawn, fork, forkserver"):
        DDPStrategy(start_method="thread")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["popen", "spawn", "fork", "forkserver"])
def test_launcher_starts_one_process_per_device(method: str) -> None:
    wanted = DDPStrategy(parallel_devices=CPU2 * 2, start_method=method).processes
    assert (wanted.count, wanted.start_method) == (4, method)
    launcher = launcher_for(wanted, max_restarts=2)
    assert isinstance(launcher, ElasticLauncher)
    assert (launcher.num_processes, launcher.start_method, launcher.max_restarts) == (4, method, 2)


def test_no_launcher_for_one_device_or_external_processes() -> None:
    assert DDPStrategy(parallel_devices=CPU2[:1]).processes is None
    assert DDPStrategy(parallel_devices=CPU2, cluster_environment=TorchElasticEnvironment()).processes is None
    assert DDPStrategy(parallel_devices=CPU2, cluster_environment=SLURMEnvironment()).processes is None
    assert launcher_for(None) is None
    assert launcher_for(None, max_restarts=1, external=True) is None  # torchrun restarts its own


def test_restarts_put_a_single_process_under_the_launcher() -> None:
    launcher = launcher_for(SingleDeviceStrategy().processes, max_restarts=1)
    assert (launcher.num_processes, launcher.start_method, launcher.max_restarts) == (1, "popen", 1)


def test_auto_strategy_picks_ddp_for_several_devices() -> None:
    assert isinstance(auto_strategy(parallel_devices=CPU2, cluster_environment=LocalEnvironment()), DDPStrategy)
    single = auto_strategy(parallel_devices=CPU2[:1], cluster_environment=LocalEnvironment())
    assert not isinstance(single, DDPStrategy)
