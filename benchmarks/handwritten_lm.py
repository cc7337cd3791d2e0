"""The LM baseline: `python -m runner experiment=charlm` written by hand on plain torch (one process, or DDP under torchrun).

The model and data code are the experiment's own (`runner.examples.charlm.StdlibText`, `CharTransformer`); the
loop is written here. It does the work the runner does for the same config: AdamW (the optimizer group's
weight_decay 0.01, the experiment's lr 1e-3), a DataLoader with a DistributedSampler (drop_last), next-token
cross-entropy per token over the whole global batch (each process counts its step's tokens, the count is
all-reduced, and its summed loss is back-propagated times world / count, so DDP's average of gradients is the
mean over every token of the step), loss/token sums kept as tensors and reduced over the processes every
`--log-every` steps for TensorBoard (`SummaryWriter`), validation at every epoch end and at the end, and
`last.ckpt` at the end.

    python benchmarks/handwritten_lm.py --steps 300 --out /tmp/hw                  # one process
    torchrun --nproc-per-node=2 benchmarks/handwritten_lm.py --steps 300 --out /tmp/hw2   # 2 DDP processes

Rank 0 writes `<out>/loop_start` (the wall-clock time, `time.time()`, just before the first step), so a
caller can measure start-up the same way for this script and for the runner.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: runner/
from runner.examples.charlm import CharTransformer, StdlibText  # noqa: E402

# The process set-up and the checkpoint write are handwritten.py's (this script's folder is on sys.path).
from handwritten import save, setup_process  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to train")
    p.add_argument("--out", type=Path, required=True, help="folder for TensorBoard, loop_start and last.ckpt")
    p.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    # conf/experiment/charlm.yaml's values
    p.add_argument("--batch-size", type=int, default=32, help="sequences per process")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01, help="conf/optimizer/adamw.yaml")
    p.add_argument("--ignore-index", type=int, default=-100, help="conf/task/language_model.yaml")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def keep_batch(batch):
    """The data set's `__getitems__` returns the whole batch already stacked: nothing to collate."""
    return batch


def loaders(args: argparse.Namespace, data: StdlibText, rank: int, world: int) -> tuple[DataLoader, DataLoader]:
    sampler = DistributedSampler(data.train_dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    train = DataLoader(data.train_dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                       collate_fn=keep_batch)
    val_indices = list(range(rank, len(data.val_dataset), world))  # every sequence once, no padding
    val = DataLoader(data.val_dataset, batch_size=args.batch_size, sampler=val_indices, collate_fn=keep_batch)
    return train, val


def all_sum(t: torch.Tensor, world: int) -> list[float]:
    t = t.clone()
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


def token_loss(logits: torch.Tensor, y: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Cross-entropy summed over the scored tokens of a (B, T, V) batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=ignore_index,
                           reduction="sum")


@torch.no_grad()
def validate(model: torch.nn.Module, loader: DataLoader, args: argparse.Namespace, device: torch.device,
             world: int) -> float:
    """Loss per token over the whole validation set, every sequence counted once across processes."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        sums[0] += token_loss(model(x), y, args.ignore_index)
        sums[1] += (y != args.ignore_index).sum()
    model.train()
    loss, tokens = all_sum(sums, world)
    return loss / max(tokens, 1.0)


class TrainMeter:
    """Sequences, tokens and the loss sum since the last log step, kept as a tensor (no sync per step)."""

    def __init__(self, device: torch.device, world: int, writer: SummaryWriter | None) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.world, self.writer, self.tick = world, writer, time.perf_counter()
        self.last_step = 0

    def update(self, sequences: int, tokens: torch.Tensor, loss_sum: torch.Tensor) -> None:
        self.sums[0] += sequences
        self.sums[1] += tokens
        self.sums[2] += loss_sum.detach()

    def log(self, step: int, lr: float) -> None:
        """Reduce over the processes (every rank calls this), then rank 0 writes."""
        sequences, tokens, loss_sum = all_sum(self.sums, self.world)
        self.sums.zero_()
        now = time.perf_counter()
        elapsed, self.tick, self.last_step = now - self.tick, now, step
        if self.writer:
            loss = loss_sum / max(tokens, 1.0)
            for name, value in (("train/loss", loss), ("train/perplexity", math.exp(min(loss, 700.0))), ("lr", lr),
                                ("throughput/samples_per_s", sequences / elapsed),
                                ("throughput/tokens_per_s", tokens / elapsed)):
                self.writer.add_scalar(name, value, step)


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    torch.manual_seed(args.seed)
    model = CharTransformer(vocab_size=StdlibText.vocab_size, block_size=args.block_size, d_model=args.d_model,
                            n_layers=args.n_layers, n_heads=args.n_heads).to(device)
    net = DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    data = StdlibText(block_size=args.block_size, batch_size=args.batch_size, max_bytes=args.max_bytes,
                      val_fraction=args.val_fraction, seed=args.seed)
    train_loader, val_loader = loaders(args, data, rank, world)
    writer = SummaryWriter(str(args.out / "tensorboard")) if rank == 0 else None
    meter = TrainMeter(device, world, writer)
    if rank == 0:
        (args.out / "loop_start").write_text(repr(time.time()))
    step = 0
    for epoch in range(math.ceil(args.steps / len(train_loader))):
        train_loader.sampler.set_epoch(epoch)
        step = train_epoch(args, net, opt, train_loader, step, meter, world)
        if meter.last_step != step:  # the last steps since a log step
            meter.log(step, opt.param_groups[0]["lr"])
        val_loss = validate(model, val_loader, args, device, world)
        if writer:
            writer.add_scalar("val/loss", val_loss, step)
            writer.add_scalar("val/perplexity", math.exp(min(val_loss, 700.0)), step)
    if rank == 0:
        save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, args.out / "last.ckpt")
        writer.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def train_epoch(args: argparse.Namespace, net: torch.nn.Module, opt: torch.optim.Optimizer, loader: DataLoader,
                step: int, meter: TrainMeter, world: int) -> int:
    """Train until the epoch or `--steps` ends; returns the step reached."""
    device = next(net.parameters()).device
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        tokens = (y != args.ignore_index).sum()
        count = tokens.float()
        if world > 1:
            dist.all_reduce(count)  # the tokens of the whole step, over every process
        loss_sum = token_loss(net(x), y, args.ignore_index)
        # DDP averages gradients over the processes: world / count makes it the mean over every token.
        (loss_sum * world / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        meter.update(len(y), tokens, loss_sum)
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
