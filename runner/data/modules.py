"""Data modules: `prepare_data()` once per node, `setup(stage)` in every process, DataLoaders read whole, and the
processes' agreement on what they built."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate

from runner.data.batches import collate
from runner.heartbeat import BUILT, PREPARE, PREPARED, SETUP, NoHeartbeat
from runner.values import is_int

# Every split a data object may have, in the order an agreement across processes compares them.
SPLITS = ("train", "val", "test", "predict")
# The splits each stage reads (fit tests afterwards, when the data has a test split: see `ready`).
STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


def is_data_module(data: Any) -> bool:
    """Whether the data makes its data sets in prepare_data()/setup(), as a LightningDataModule does: they exist
    only once the worker has called them."""
    return any(callable(getattr(data, name, None)) for name in ("prepare_data", "setup"))


def prepare(data: Any, strategy: Any, stage: str, trainer: Any = None, beat: Any = NoHeartbeat()) -> Any:
    """A LightningDataModule's order: `prepare_data()` once per node (its local rank 0; the other processes wait),
    then `setup(stage)` in every process; the data the runner's loaders read comes back (see `ready`). A data object
    with a `trainer` attribute (a LightningDataModule's) gets `trainer`, the run's view, before both. `beat`: this
    process's heartbeat, told each phase, so that the launcher's stall watch names a hook that hangs."""
    from runner.lightning.trainer_view import attach_to_data

    attach_to_data(trainer, data)
    if callable(getattr(data, "prepare_data", None)):
        _once_per_node(data.prepare_data, strategy, per_node=getattr(data, "prepare_data_per_node", True), beat=beat)
    return ready(data, stage, beat)


def ready(data: Any, stage: str, beat: Any = NoHeartbeat()) -> Any:
    """`data` after `setup(stage)` (where it has one): itself, or, when it gives DataLoaders for the stage's splits
    (`train_dataloader()`, ...) instead of data sets, a LoaderData of them."""
    source = data.source if isinstance(data, LoaderData) else data
    hook = f"data.setup({stage!r})" if callable(getattr(source, "setup", None)) else ""
    if hook:
        from runner.errors import call_hook

        beat.phase(SETUP, hook)
        call_hook(hook, lambda: source.setup(stage))
    beat.phase(BUILT, f"its start-up after {hook or 'building the data'}, before its first step")
    splits = STAGE_SPLITS[stage]
    gives_loaders = any(getattr(source, f"{split}_dataset", None) is None and _loader_method(source, split)
                        for split in splits)
    return LoaderData(source, splits) if gives_loaders else source


def _loader_method(source: Any, split: str) -> Optional[Callable[[], Any]]:
    """`source.<split>_dataloader`, unless it is Lightning's placeholder (its DataHooks' raise when not overridden)."""
    name = f"{split}_dataloader"
    owner = next((cls for cls in type(source).__mro__ if name in vars(cls)), None)
    method = getattr(source, name, None)
    return method if callable(method) and not (owner is not None and owner.__name__ == "DataHooks") else None


def _once_per_node(prepare_data: Callable[[], Any], strategy: Any, per_node: bool,
                   beat: Any = NoHeartbeat()) -> None:
    """Call `prepare_data` in one process per node (or of the job, `per_node` False) while the others wait; a
    failure there ends every process (the others with a line that points to it)."""
    from runner.errors import HookFailed, WorkerFailed, call_hook
    from runner.processes import FOLLOWS_ANOTHER

    chosen = strategy is None or (strategy.local_rank if per_node else strategy.global_rank) == 0
    where = "local rank 0 of a node" if per_node else "global rank 0"
    error: Optional[BaseException] = None
    if chosen:
        beat.phase(PREPARE, "data.prepare_data()")
        try:
            call_hook("data.prepare_data()", prepare_data, f"on {where}")
        except HookFailed as raised:  # re-raised below, after the others know
            error = raised
    beat.phase(PREPARED, f"the wait for data.prepare_data() on {where}")
    failed = strategy.reduce_boolean_decision(error is not None, all=False) if strategy is not None else False
    if error is not None:
        raise error
    if failed:  # a consequence, said without a traceback: the launcher reports the cause
        raise WorkerFailed(strategy.global_rank, f"data.prepare_data() failed on {where}; {FOLLOWS_ANOTHER}")


_PLAIN_SAMPLERS = (RandomSampler, SequentialSampler)  # what DataLoader(shuffle=True/False) makes itself


class LoaderData:
    """The data sets of a data object's DataLoaders (`<split>_dataloader()`, as a LightningDataModule gives them),
    with each loader's batch_size, collate_fn, num_workers and pin_memory, and the training loader's own sampler.

    The runner takes each process's share (the same global batches on any number of processes, every evaluation
    sample once, an exact resume), so a loader's shuffle, drop_last and other settings are not kept. A training
    loader's own sampler (weighted, class-balanced) is the global order the shares are taken from; an evaluation
    loader's sampler, or a batch sampler of its own, is refused.
    """

    def __init__(self, source: Any, splits: tuple[str, ...]) -> None:
        from runner.config import ConfigError

        self.source = source
        self.split_settings: dict[str, dict] = {}
        for split in splits:
            dataset = getattr(source, f"{split}_dataset", None)
            make = _loader_method(source, split)
            loader = make() if dataset is None and make is not None else None
            if dataset is not None or loader is None:
                setattr(self, f"{split}_dataset", dataset)
                continue
            problem, sampler = _taken_sampler(loader, f"data ({type(source).__name__}): {split}_dataloader()", split)
            if problem:
                raise ConfigError([problem])
            setattr(self, f"{split}_dataset", loader.dataset)
            # torch's default collate is the runner's, which also passes a batch fetched whole (__getitems__)
            own_collate = loader.collate_fn if loader.collate_fn is not default_collate else collate
            self.split_settings[split] = {"batch_size": loader.batch_size, "collate_fn": own_collate,
                                          "num_workers": loader.num_workers, "pin_memory": loader.pin_memory,
                                          "sampler": sampler}
        first = next(iter(self.split_settings.values()), {})  # what a data set given as such is read with
        self.batch_size = first.get("batch_size", getattr(source, "batch_size", None))
        self.collate_fn = first.get("collate_fn", getattr(source, "collate_fn", collate))
        self.num_workers = first.get("num_workers", getattr(source, "num_workers", 0))
        self.pin_memory = first.get("pin_memory", getattr(source, "pin_memory", False))


def _taken_sampler(loader: DataLoader, what: str, split: str) -> tuple[Optional[str], Optional[Sampler]]:
    """Why the runner cannot take `loader` as it is (not one DataLoader, no batching, a batch sampler of its own, a
    sampler of its own for evaluation or without a length), else the training sampler to draw the order from."""
    if not isinstance(loader, DataLoader):
        return (f"{what} gave {type(loader).__name__}, not one DataLoader: the runner reads one loader per stage "
                f"(for several data sets, concatenate them, or give the one to use as {split}_dataset)"), None
    if loader.batch_size is None and loader.batch_sampler is None:
        return f"{what} has batch_size=None (no batching): give it a batch size (per process)", None
    if isinstance(loader.dataset, IterableDataset):  # a stream: torch's placeholder sampler, nothing to take
        return None, None
    if loader.batch_size is None:  # DataLoader's batch_size is None exactly when it was given a batch_sampler
        return (f"{what} has a batch sampler of its own ({type(loader.batch_sampler).__name__}): batches it "
                "composes cannot be split into the same global batches on any number of processes; give a sampler "
                "(an order of samples) and a batch_size instead"), None
    if isinstance(loader.sampler, DistributedSampler):  # one process's share: the runner takes the shares itself
        return None, None
    plain = type(loader.sampler) in _PLAIN_SAMPLERS and not (
        isinstance(loader.sampler, RandomSampler) and (loader.sampler.replacement
                                                       or loader.sampler._num_samples is not None))
    if plain:
        return None, None
    own = type(loader.sampler).__name__
    if split != "train":
        return (f"{what} has a sampler of its own ({own}); evaluation reads every sample once, split over the "
                f"processes, so give a DataLoader without sampler, or the data set itself as {split}_dataset"), None
    if not hasattr(loader.sampler, "__len__"):
        return (f"{what} has a sampler of its own ({own}) without len(): the runner needs the samples an epoch "
                "has to plan its steps; give the sampler a __len__"), None
    return None, loader.sampler


# What `data_facts` says of a split the data lacks, of one without a length (a stream), and of a batch_size that is
# not an integer.
_ABSENT, _NO_LENGTH, _NOT_INT = -1, -2, -3


def data_facts(data: Any) -> list[int]:
    """What every process must build alike: the per-process batch_size, then the length of each split (SPLITS),
    or whether it has none (`_ABSENT`) or one without a length (`_NO_LENGTH`)."""
    batch_size = getattr(data, "batch_size", None)
    return [batch_size if is_int(batch_size) else _NOT_INT, *(_length(getattr(data, f"{split}_dataset", None))
                                                            for split in SPLITS)]


def _length(dataset: Any) -> int:
    if dataset is None:
        return _ABSENT
    try:
        return len(dataset)
    except (TypeError, NotImplementedError):  # a stream need not know its length
        return _NO_LENGTH


def rank_difference(data: Any, strategy: Any) -> Optional[str]:
    """How the data of some process differs from global rank 0's, in one line, or None: each process sends its
    `data_facts` in one collective (a sum of rows of zeros, each process filling its own), every process calls it.

    The runner splits one global order over the processes, so each must hold the same data sets: a rank with fewer
    samples or another batch size would train other global batches, and its collectives would stop matching.
    """
    if strategy is None or strategy.world_size < 2:
        return None
    facts = data_facts(data)
    table = torch.zeros(strategy.world_size, len(facts), dtype=torch.int64, device=strategy.root_device)
    table[strategy.global_rank] = torch.tensor(facts, dtype=torch.int64)
    rows = strategy.all_reduce(table, reduce_op="sum").tolist()
    source = data.source if isinstance(data, LoaderData) else data
    return facts_difference(rows, "setup(stage)" if callable(getattr(source, "setup", None)) else "its constructor")


def facts_difference(rows: list[list[int]], maker: str) -> Optional[str]:
    """The first difference of a rank's `data_facts` row from rank 0's, in words; `maker`: what made the data."""
    for rank, row in enumerate(rows[1:], start=1):
        index = next((i for i, (mine, first) in enumerate(zip(row, rows[0])) if mine != first), None)
        if index is None:
            continue
        theirs, first = _fact(index, row[index]), _fact(index, rows[0][index])
        if row[index] >= 0 and rows[0][index] >= 0:  # two numbers of one kind: "..., rank 0 has 256"
            first = str(rows[0][index])
        return (f"data: rank {rank} has {theirs}, rank 0 has {first}; every process must build the same data "
                f"({maker} must not depend on the rank)")
    return None


def _fact(index: int, value: int) -> str:
    if index == 0:
        return "no integer batch_size" if value == _NOT_INT else f"batch_size {value}"
    split = SPLITS[index - 1]
    if value == _ABSENT:
        return f"no {split} set"
    return f"a {split} set without a length" if value == _NO_LENGTH else f"{value} {split} samples"
