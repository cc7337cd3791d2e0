"""The LM step on a GPU: the runner's `Loop` against handwritten_lm.py's step (and Lightning Fabric's), in one process.

The job is `experiment=charlm`'s model and data at two sizes: as shipped (d_model 128, 2 layers, 4 heads, block 128,
batch 32, 32-true) and at d_model 768, 12 layers, 12 heads, block 512, batch 16 with bf16-mixed (85 M parameters).
Each variant trains its own model on the same batches, in blocks of `--steps` steps timed wall-clock between two
device synchronisations; rounds alternate which variant goes first, and the warm-up steps are not timed:

  * hand-written: handwritten_lm.py's step (forward, per-token loss sum, backward of loss * world / count, AdamW
    with torch's defaults, the loss sums kept on the device and read every `--log-every` steps), autocast for bf16;
  * runner: `Loop.train_step` and `Loop._after_step` built as runner.worker builds them, with the config's
    defaults (on CUDA: fused AdamW, TF32 matmuls for 32-true);
  * runner, torch defaults: the same with `precision.tf32=false +optimizer.foreach=true` (what the hand-written
    loop gets from torch on CUDA), so the ratio to it is the loop's own cost;
  * fabric: the same step written with Lightning Fabric (when `lightning` is importable);
  * runner, compiled (`--compile`): the runner with `trainer.compile=true` (its compilation is in the warm-up).

It prints per-step milliseconds, the per-round ratio to the hand-written step, tokens/s, the model FLOP rate
(FLOPs counted once on the meta device by runner.flops) and MFU against the GPU's datasheet peak.

    python benchmarks/gpu_lm.py                                   # on a GPU: both sizes
    python benchmarks/gpu_lm.py --device cpu --small --rounds 2   # the same code on CPU, small sizes
    python benchmarks/gpu_lm.py --count-ops                       # operators of one step, runner vs hand-written (CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from handwritten_lm import TrainMeter, token_loss  # noqa: E402

IGNORE = -100


@dataclass
class Size:
    name: str
    d_model: int
    n_layers: int
    n_heads: int
    block: int
    batch: int
    precision: str
    steps: int  # timed steps per block
    max_bytes: int = 2_000_000

    def overrides(self) -> list[str]:
        return [f"model.d_model={self.d_model}", f"model.n_layers={self.n_layers}", f"model.n_heads={self.n_heads}",
                f"data.block_size={self.block}", f"data.batch_size={self.batch}", f"precision={self.precision}",
                f"data.max_bytes={self.max_bytes}"]


SIZES = [Size("as shipped", 128, 2, 4, 128, 32, "32-true", 50), Size("85M", 768, 12, 12, 512, 16, "bf16-mixed", 20)]
SMALL = [Size("small", 64, 2, 4, 64, 8, "32-true", 4, 200_000), Size("small bf16", 128, 2, 4, 128, 8, "bf16-mixed", 2,
                                                                      200_000)]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true", help="small sizes (for a CPU check)")
    p.add_argument("--sizes", nargs="+", type=int, help="indices of the sizes to run (default: all)")
    p.add_argument("--rounds", type=int, default=8, help="rounds; each times one block of every variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of every variant first")
    p.add_argument("--log-every", type=int, default=20, help="trainer.log_every_n_steps, and the hand loop's")
    p.add_argument("--compile", action="store_true", help="add the runner with trainer.compile=true")
    p.add_argument("--no-fabric", action="store_true", help="leave Lightning Fabric out even when importable")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (a busy machine's spare cores)")
    p.add_argument("--count-ops", action="store_true", help="count the operators of one step on CPU and exit")
    return p.parse_args(argv)


def lm_config(size: Size, device: str, log_every: int, *extra: str):
    from runner.config import compose as runner_compose

    return runner_compose(["experiment=charlm", f"accelerator={device}", "trainer.devices=1", "strategy=single",
                           "cluster=local", "logger=none", f"trainer.log_every_n_steps={log_every}",
                           "trainer.val_check_interval=1000000000", *size.overrides(), *extra])


def runner_step(cfg) -> tuple[Callable[[tuple], None], object]:
    """`Loop.train_step` and `Loop._after_step` on a Loop built the way runner.worker builds it; and its strategy."""
    from runner import build
    from runner.data import train_loader
    from runner.loggers import NullLogger
    from runner.loop import Loop
    from runner.tasks import TaskModule

    strategy = build.build_strategy(cfg)
    strategy.setup_environment()
    torch.manual_seed(cfg.trainer.seed)
    precision = strategy.precision
    with precision.module_init_context():
        model = build.build_model(cfg)
    task = TaskModule(precision.convert_module(model), build.build_task(cfg), precision)
    strategy.module_to_device(task)
    arguments = build.compile_arguments(cfg)
    if arguments is not None:
        task.compile(**arguments)
    wrapped = strategy.setup_module(task)
    optimizer = build.build_optimizer(cfg, model.parameters())
    loader = train_loader(build.build_data(cfg), strategy.distributed_sampler_kwargs, cfg.trainer.seed)
    loop = Loop(strategy, task, wrapped, optimizer, build.build_scheduler(cfg, optimizer, 10**9), loader, None,
                NullLogger(), cfg.trainer, Path(tempfile.mkdtemp()), lambda: 0, {})
    loop.train_log.tick = time.perf_counter()

    def step(batch: tuple) -> None:
        loop.train_step([batch])
        loop.progress.step += 1  # as Loop._run counts it
        loop._after_step()

    return step, strategy


def hand_step(size: Size, device: torch.device, log_every: int) -> Callable[[tuple], None]:
    """handwritten_lm.py's step on its own model: torch's defaults, autocast for bf16-mixed."""
    from runner.examples.charlm import CharTransformer

    torch.manual_seed(0)
    model = CharTransformer(block_size=size.block, d_model=size.d_model, n_layers=size.n_layers,
                            n_heads=size.n_heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    meter, count = TrainMeter(device, 1, None), [0]
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if size.precision == "bf16-mixed" \
        else contextlib.nullcontext

    def step(batch: tuple) -> None:
        x, y = batch[0].to(device), batch[1].to(device)
        tokens = (y != IGNORE).sum()
        with autocast():
            loss_sum = token_loss(model(x), y, IGNORE)
        (loss_sum / tokens.float()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.update(len(y), tokens, loss_sum)
        count[0] += 1
        if count[0] % log_every == 0:
            meter.log(count[0], opt.param_groups[0]["lr"])

    return step


def fabric_step(size: Size, device: torch.device, log_every: int) -> Optional[Callable[[tuple], None]]:
    """The hand-written step through Lightning Fabric (None when lightning is not installed)."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        return None
    from runner.examples.charlm import CharTransformer

    fabric = Fabric(accelerator=device.type, devices=1, precision=size.precision)
    torch.manual_seed(0)
    model = CharTransformer(block_size=size.block, d_model=size.d_model, n_layers=size.n_layers, n_heads=size.n_heads)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    meter, count = TrainMeter(fabric.device, 1, None), [0]

    def step(batch: tuple) -> None:
        x, y = fabric.to_device(batch)
        tokens = (y != IGNORE).sum()
        loss_sum = token_loss(model(x), y, IGNORE)
        fabric.backward(loss_sum / tokens.float())
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.update(len(y), tokens, loss_sum)
        count[0] += 1
        if count[0] % log_every == 0:
            meter.log(count[0], opt.param_groups[0]["lr"])

    return step


@dataclass
class Variant:
    name: str
    step: Callable[[tuple], None]
    tf32: tuple  # the process's TF32 settings while it runs (runner.precision.precision.tf32_settings)


def build_variants(args: argparse.Namespace, size: Size) -> tuple[list[Variant], list[tuple]]:
    """Every variant of `size`, and the batches they share."""
    from runner.precision.precision import tf32_settings

    torch_default = tf32_settings()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    variants = [Variant("hand-written", hand_step(size, device, args.log_every), torch_default)]
    # What torch picks unasked: foreach on CUDA; on CPU a loop over the tensors, which the runner keeps there.
    defaults = (*(("+optimizer.foreach=true",) if args.device == "cuda" else ()),
                *(("precision.tf32=false",) if size.precision == "32-true" else ()))
    runs = [("runner", ()), ("runner, torch defaults", defaults)]
    cfg = None
    for name, extra in runs:
        cfg = lm_config(size, args.device, args.log_every, *extra)
        step, strategy = runner_step(cfg)
        variants.append(Variant(name, step, tf32_settings()))
        strategy.precision.teardown()  # the process's settings back; the variant sets its own around each block
    try:
        fabric = None if args.no_fabric else fabric_step(size, device, args.log_every)
    except Exception as error:  # noqa: BLE001 - Fabric's column is a comparison, not what is measured
        print(f"fabric: not measured ({type(error).__name__}: {error})", flush=True)
        fabric = None
    if fabric is not None:
        variants.append(Variant("fabric", fabric, torch_default))
    return variants, shared_batches(cfg, 16)


def shared_batches(cfg, count: int) -> list[tuple]:
    from runner import build
    from runner.data import train_loader

    loader = train_loader(build.build_data(cfg), None, cfg.trainer.seed)
    it = iter(loader)
    return [tuple(next(it)) for _ in range(count)]


def time_blocks(variants: list[Variant], batches: list[tuple], args: argparse.Namespace, steps: int,
                sync: Callable[[], None]) -> dict[str, list[float]]:
    """Seconds per step of each variant, one value per round; the first variant in a round rotates."""
    from runner.precision.precision import set_tf32_settings

    cursor = {v.name: 0 for v in variants}

    def block(v: Variant, n: int) -> float:
        set_tf32_settings(v.tf32)
        sync()
        start = time.perf_counter()
        for _ in range(n):
            v.step(batches[cursor[v.name] % len(batches)])
            cursor[v.name] += 1
        sync()
        return (time.perf_counter() - start) / n

    for v in variants:
        block(v, args.warmup)
    out: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            out[v.name].append(block(v, steps))
    return out


def flops_per_step(cfg, batch: tuple) -> float:
    from runner import build
    from runner.flops import count_flops
    from runner.precision import Precision
    from runner.tasks import TaskModule

    with torch.device("meta"):
        model = build.build_model(cfg)
    return count_flops(TaskModule(model, build.build_task(cfg), Precision()), batch)


def peak(size: Size, device: str) -> tuple[str, Optional[float]]:
    """The GPU's datasheet peak for the runner's precision at this size ("", None where unknown)."""
    from runner.flops import peak_tflops, precision_kind

    if device != "cuda":
        return "", None
    kind = "tf32" if size.precision == "32-true" else precision_kind(size.precision, torch.device("cuda", 0))
    found = peak_tflops(torch.cuda.get_device_name(0), kind)
    return (f"{found[0]} {kind} {found[1]:g}", found[1]) if found else (f"{kind}: unknown GPU", None)


def report(size: Size, times: dict[str, list[float]], flops: float, args: argparse.Namespace) -> list[str]:
    label, peak_value = peak(size, args.device)
    hand = times["hand-written"]
    rows = [f"| variant | ms/step median (min-max) | / hand-written per round, median (min-max) | tokens/s | "
            f"TFLOP/s | MFU ({label or 'no peak'}) |", "|---|---|---|---|---|---|"]
    for name, seconds in times.items():
        ms = [s * 1e3 for s in seconds]
        ratios = [a / b for a, b in zip(seconds, hand)]
        step = statistics.median(seconds)
        tflops = flops / step / 1e12
        mfu = f"{tflops / peak_value:.3f}" if peak_value else "-"
        rows.append(f"| {name} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) | "
                    f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
                    f"{size.batch * size.block / step:,.0f} | {tflops:.3g} | {mfu} |")
    return rows


def run_size(args: argparse.Namespace, size: Size) -> None:
    variants, batches = build_variants(args, size)
    cfg = lm_config(size, args.device, args.log_every)
    flops = flops_per_step(cfg, batches[0])
    params = sum(p.numel() for p in _meta_model(cfg).parameters())
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = time_blocks(variants, batches, args, size.steps, sync)
    print_table(args, size, params, flops, times)
    if args.compile:  # after the eager table, so a slow compilation cannot cost it
        from runner.precision.precision import tf32_settings

        step, strategy = runner_step(lm_config(size, args.device, args.log_every, "trainer.compile=true"))
        compiled = Variant("runner, trainer.compile=true", step, tf32_settings())
        strategy.precision.teardown()
        print_table(args, size, params, flops, time_blocks([variants[0], compiled], batches, args, size.steps, sync))


def print_table(args: argparse.Namespace, size: Size, params: int, flops: float, times: dict) -> None:
    print(f"\n## {size.name}: d_model {size.d_model}, {size.n_layers} layers, {size.n_heads} heads, "
          f"block {size.block}, batch {size.batch}, {size.precision}; {params / 1e6:.1f} M parameters, "
          f"{flops / 1e9:.1f} GFLOP per step; {args.rounds} rounds x {size.steps} steps", flush=True)
    print("\n".join(report(size, times, flops, args)), flush=True)


def _meta_model(cfg) -> torch.nn.Module:
    from runner import build

    with torch.device("meta"):
        return build.build_model(cfg)


def count_ops(args: argparse.Namespace) -> None:
    """aten operators of one step (after warm-up), runner against hand-written, on CPU: a GPU launches a kernel
    for each leaf operator, so a difference here is a difference in launches there."""
    from torch.profiler import ProfilerActivity, profile

    args.device, args.compile, args.no_fabric = "cpu", False, True
    size = (SMALL if args.small else SIZES)[0]
    variants, batches = build_variants(args, size)
    counts = {}
    for v in variants:
        for batch in batches[:3]:
            v.step(batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            v.step(batches[3])
        counts[v.name] = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    hand = counts["hand-written"]
    for name, ops in counts.items():
        print(f"{name}: {sum(ops.values())} aten operators per step (nested calls included)")
    for name, ops in list(counts.items())[1:]:
        diff = sorted(((ops[k] - hand[k], k) for k in set(ops) | set(hand) if ops[k] != hand[k]),
                      key=lambda d: -abs(d[0]))
        print(f"{name} - hand-written: " + (", ".join(f"{k} {d:+d}" for d, k in diff[:12]) or "none"))


def main() -> None:
    args = parse_args()
    if args.device == "cpu" or args.count_ops:
        torch.set_num_threads(args.threads)
    if args.count_ops:
        count_ops(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu --small")
    sizes = SMALL if args.small else SIZES
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {device}; warm-up {args.warmup} steps per variant", flush=True)
    for index in args.sizes or range(len(sizes)):
        run_size(args, sizes[index])


if __name__ == "__main__":
    main()
