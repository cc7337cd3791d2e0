"""The baseline: the benchmark's training job written by hand on plain torch (one process, or DDP under torchrun).

It does the work `python -m runner` does for the same config: the same synthetic data and MLP, SGD, a
DataLoader with a DistributedSampler, train loss/accuracy reduced over the processes and written to
TensorBoard every `--log-every` steps, validation at every epoch end and at the end, and
`last.ckpt` at the end.

    python benchmarks/handwritten.py --steps 300 --out /tmp/hw                  # one process
    torchrun --nproc-per-node=2 benchmarks/handwritten.py --steps 300 --out /tmp/hw2   # 2 DDP processes
    torchrun --nproc-per-node=2 benchmarks/handwritten.py --fsdp --steps 300 --out /tmp/hw3   # 2 FSDP2 processes

With `--fsdp` the model is sharded with FSDP2 as strategy=fsdp shards it by default (each Linear, then the
whole model) and `last.ckpt` is a torch.distributed.checkpoint folder every rank writes its shards into.

Rank 0 writes `<out>/loop_start` (the wall-clock time, `time.time()`, just before the first step), so a
caller can measure start-up the same way for this script and for the runner.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch.utils.tensorboard import SummaryWriter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to train")
    p.add_argument("--out", type=Path, required=True, help="folder for TensorBoard, loop_start and last.ckpt")
    p.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--num-features", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--num-samples", type=int, default=4096)
    p.add_argument("--val-samples", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    return p.parse_args(argv)


def make_data(args: argparse.Namespace) -> tuple[TensorDataset, TensorDataset]:
    """Gaussian inputs labelled by a fixed random two-layer teacher (the recipe of runner's `data=synthetic`)."""
    g = torch.Generator().manual_seed(args.seed)
    f, hidden = args.num_features, 4 * args.num_features
    w1 = torch.randn(f, hidden, generator=g) / math.sqrt(f)
    w2 = torch.randn(hidden, args.num_classes, generator=g) / math.sqrt(hidden)

    def make(n: int) -> TensorDataset:
        x = torch.randn(n, f, generator=g)
        return TensorDataset(x, (torch.tanh(x @ w1) @ w2).argmax(dim=1))

    return make(args.num_samples), make(args.val_samples)


def make_model(args: argparse.Namespace) -> nn.Module:
    layers: list[nn.Module] = []
    width = args.num_features
    for _ in range(args.depth):
        layers += [nn.Linear(width, args.hidden), nn.ReLU()]
        width = args.hidden
    return nn.Sequential(*layers, nn.Linear(width, args.num_classes))


def setup_process(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """Join the process group when torchrun started us; returns (rank, world size, device)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.accelerator == "cuda" else torch.device("cpu")
    if args.accelerator == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if args.accelerator == "cuda" else "gloo")
    return rank, world, device


def all_sum(values: list[float], device: torch.device, world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def validate(model: nn.Module, loader: DataLoader, device: torch.device, world: int) -> list[float]:
    """[loss, accuracy] over the whole validation set, each sample counted once across processes."""
    model.eval()
    loss = correct = count = 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss += nn.functional.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        count += len(y)
    model.train()
    loss, correct, count = all_sum([loss, correct, count], device, world)
    return [loss / count, correct / count]


def loaders(args: argparse.Namespace, rank: int, world: int) -> tuple[DataLoader, DataLoader]:
    train_set, val_set = make_data(args)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    train = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    val_indices = list(range(rank, len(val_set), world))  # every sample once, no padding
    val = DataLoader(torch.utils.data.Subset(val_set, val_indices), batch_size=args.batch_size)
    return train, val


def save(state: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


class TrainMeter:
    """Loss, correct predictions and samples since the last log step, kept as tensors (no sync per step)."""

    def __init__(self, device: torch.device, world: int, writer: SummaryWriter | None) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.world, self.writer, self.tick = world, writer, time.perf_counter()

    def update(self, loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        self.sums[0] += loss.detach() * len(y)
        self.sums[1] += (out.detach().argmax(1) == y).sum()
        self.sums[2] += len(y)

    def log(self, step: int, lr: float) -> None:
        """Reduce over the processes (every rank calls this), then rank 0 writes."""
        loss, correct, count = all_sum(self.sums.tolist(), self.sums.device, self.world)
        self.sums.zero_()
        now, elapsed = time.perf_counter(), time.perf_counter() - self.tick
        self.tick = now
        if self.writer:
            for name, value in (("train/loss", loss / count), ("train/acc", correct / count), ("lr", lr),
                                ("throughput/samples_per_s", count / elapsed)):
                self.writer.add_scalar(name, value, step)


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    torch.manual_seed(args.seed)
    model = make_model(args).to(device)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        net = fully_shard(model)
    else:
        net = DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    train_loader, val_loader = loaders(args, rank, world)
    writer = SummaryWriter(str(args.out / "tensorboard")) if rank == 0 else None
    meter = TrainMeter(device, world, writer)
    if rank == 0:
        (args.out / "loop_start").write_text(repr(time.time()))
    step = 0
    for epoch in range(math.ceil(args.steps / len(train_loader))):
        train_loader.sampler.set_epoch(epoch)
        step = train_epoch(args, net, opt, train_loader, step, meter)
        val_loss, val_acc = validate(model, val_loader, device, world)
        if writer:
            writer.add_scalar("val/loss", val_loss, step)
            writer.add_scalar("val/acc", val_acc, step)
    if args.fsdp:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()["state"]},
                 checkpoint_id=str(args.out / "last.ckpt"))
    elif rank == 0:
        save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, args.out / "last.ckpt")
    if rank == 0:
        writer.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def train_epoch(args: argparse.Namespace, net: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader,
                step: int, meter: TrainMeter) -> int:
    """Train until the epoch or `--steps` ends; returns the step reached."""
    device = next(net.parameters()).device
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = net(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        meter.update(loss, out, y)
        if step % args.log_every == 0:
            meter.log(step, opt.param_groups[0]["lr"])
        if step >= args.steps:
            break
    return step


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rank, world, device = setup_process(args)
    train(args, rank, world, device)


if __name__ == "__main__":
    main()
