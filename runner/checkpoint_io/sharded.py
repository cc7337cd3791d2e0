"""Sharded checkpoints: a folder each process writes its shards into (torch.distributed.checkpoint), read on any count.

Layout of `<name>.ckpt/` (a folder where a full checkpoint is a file, so every path, glob and `ckpt_path=last`
works for both):
- `.metadata`, `__<rank>_0.distcp` — DCP's files: the model's tensors (`model.<key>`) and each optimizer's
  per-parameter tensors (`optimizers.<k>.<parameter name>.<name>`; folders written before names:
  `optimizer_state.<index>.<name>`), each with its global shape, so any number of processes can read the parts
  they hold, whatever groups the optimizer has.
- `state.pt` — everything else of the checkpoint (step, epoch, data position, RNG, scheduler, optimizer
  settings with each group's parameters by name, callbacks), written by rank 0 with torch.save and read with `weights_only=True`.
- `checksums.json` — a CRC-32 of each file above, written last by rank 0; checked before anything is read.

A save goes to `.<name>.tmp-<token>/` and is renamed into place once every rank has written: a crash at any
point leaves the previous checkpoint whole. DCP pickles non-tensor values (and unpickles them with
`weights_only=False`), so only tensors go through it; its `.metadata` is read by `dcp_metadata`, never by pickle.
"""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from runner.checkpoint_io import manifest, optimizer_keys
from runner.checkpoint_io.base import CheckpointError
from runner.checkpoint_io.dcp_metadata import METADATA_FILE, read_metadata, safe_reader
from runner.checkpoint_io.torch_io import fsync_dir, remove_path, replace

STATE_FILE = "state.pt"
# (path inside the checkpoint, global size, dtype, the checkpoint's other entries) -> the tensor to read it into.
Allocate = Callable[[tuple, torch.Size, torch.dtype, dict], torch.Tensor]


def is_sharded(path: Any) -> bool:
    return Path(path).is_dir() and (Path(path) / METADATA_FILE).is_file()


def split(checkpoint: dict, parameter_names: list[str]) -> tuple[dict, dict]:
    """(the tensors DCP writes, the rest) of a checkpoint with `model` and `optimizer` as the loop saves them.

    Each optimizer's per-parameter tensors go under `optimizers.<k>.<parameter name>.<name>` (k: its place in a set
    of optimizers, 0 for one), so a run with other groups or another process count finds them by name;
    `parameter_names` are the model's in order (what an unnamed single-group optimizer numbers)."""
    states = optimizer_keys.states_of(checkpoint["optimizer"])
    tensors: dict = {"model": dict(checkpoint["model"]), "optimizers": {}}
    kept = []
    for k, (state, names) in enumerate(zip(states, optimizer_keys.index_names(states, parameter_names))):
        named = optimizer_keys.by_name(state, names)
        tensors["optimizers"][str(k)] = {name: {key: v for key, v in entries.items() if isinstance(v, torch.Tensor)}
                                         for name, entries in named["state"].items()}
        kept.append({**named, "state": {name: {key: v for key, v in entries.items()
                                               if not isinstance(v, torch.Tensor)}
                                        for name, entries in named["state"].items()}})
    rest = {**checkpoint, "optimizer": optimizer_keys.with_states(checkpoint["optimizer"], kept)}
    del rest["model"]
    return tensors, rest


def join(tensors: dict, rest: dict) -> dict:
    """The checkpoint `split` took apart, each optimizer's state keyed by index again (in its groups' order, as
    torch numbers it). A folder written before names (`optimizer_state.<index>.<name>`) joins as it was."""
    states = optimizer_keys.states_of(rest["optimizer"])
    if not any(optimizer_keys.is_named(state) for state in states):
        return _join_indexed(tensors, rest)
    joined = []
    for k, state in enumerate(states):
        stored = tensors.get("optimizers", {}).get(str(k), {})
        entries = {name: {**dict(values), **stored.get(name, {})} for name, values in state.get("state", {}).items()}
        entries.update({name: dict(values) for name, values in stored.items() if name not in entries})
        joined.append(optimizer_keys.by_index({**state, "state": entries}))
    return {**rest, "model": tensors["model"], "optimizer": optimizer_keys.with_states(rest["optimizer"], joined)}


def _join_indexed(tensors: dict, rest: dict) -> dict:
    optimizer = dict(rest["optimizer"])
    state = {int(k): dict(v) for k, v in optimizer.get("state", {}).items()}
    for index, entries in tensors.get("optimizer_state", {}).items():
        state.setdefault(int(index), {}).update(entries)
    optimizer["state"] = dict(sorted(state.items()))
    return {**rest, "model": tensors["model"], "optimizer": optimizer}


def temporary_path(path: Path, token: str) -> Path:
    return path.with_name(f".{path.name}.tmp-{token}")


def write(tensors: dict, rest: Optional[dict], tmp: Path, process_group: Any = None) -> None:
    """Every rank writes its shards into `tmp` (a collective); the rank passing `rest` (rank 0, DCP's
    coordinator) also writes state.pt, then the checksum manifest: DCP returns on the coordinator only after
    every rank's shards and the metadata are written.

    Tensors every rank holds alike (biases of unsharded layers, Adam's step) are written once, by rank 0.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process writing: meant
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)),
                     planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True), process_group=process_group,
                     no_dist=not dist.is_initialized())
        if rest is not None:
            with open(tmp / STATE_FILE, "wb") as file:
                torch.save(rest, file)
                file.flush()
                os.fsync(file.fileno())
            manifest.write(tmp)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's gathers every rank's failures
        if rest is not None:  # every rank is past its writes (DCP gathers them before raising): free the space
            remove_path(tmp)
        if isinstance(err, CheckpointException) and dist.is_initialized():
            # Every rank raised the gathered failure: each measures the free space after rank 0 freed it, so all
            # say the same figure (and the launcher says the message once).
            dist.barrier(group=process_group)
        raise CheckpointError(f"{write_reason(err, tmp.parent)}") from None


def publish(tmp: Path, path: Path) -> None:
    """Put the finished folder `tmp` at `path` (one process): swapped atomically with any previous checkpoint
    there, folder or file (Linux renameat2), so `path` always holds a whole checkpoint; then drop the old one and
    leftovers."""
    replace(tmp, path)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # folders of saves a crash interrupted
        remove_path(stale)
    fsync_dir(str(path.parent))


def remove(path: Any) -> None:
    remove_path(Path(path))


def read_rest(path: Any) -> dict:
    """state.pt of a folder whose checksums were verified."""
    try:
        rest = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise CheckpointError(f"sharded checkpoint {path} lacks {STATE_FILE}: it was not written completely") from err
    except Exception as err:  # noqa: BLE001 - weights-only refusals and damaged bytes alike
        raise CheckpointError(f"cannot load sharded checkpoint {path}: its {STATE_FILE} is damaged or holds objects "
                              f"that are not data ({type(err).__name__}); use an earlier checkpoint") from None
    if not isinstance(rest, dict) or not isinstance(rest.get("optimizer"), dict):
        raise CheckpointError(f"cannot load sharded checkpoint {path}: its {STATE_FILE} is not the runner's")
    return rest


def read(path: Any, allocate: Optional[Allocate] = None, process_group: Any = None,
         trust_unchecked: bool = False) -> dict:
    """The checkpoint in the sharded folder `path`, each tensor read into `allocate(...)`'s tensor.

    By default every tensor is read whole (plain tensors: what strategy=single or ddp loads). A strategy that
    shards passes tensors holding only its part (DTensors), and DCP reads just those parts; every process of
    the group must call it then. The checksums are verified first (a folder without them only if
    `trust_unchecked`).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    collective = allocate is not None and dist.is_initialized()
    manifest.verify(path, trust_unchecked)
    rest = read_rest(path)
    reader = safe_reader(path)
    metadata = reader.read_metadata()
    check_sizes(path, metadata)  # before a tensor of the declared size is allocated
    allocate = allocate or (lambda where, size, dtype, rest: torch.empty(size, dtype=dtype))
    tensors: dict = {"model": {}}
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        where = metadata.planner_data[key]
        node = tensors
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = allocate(where, item.size, item.properties.dtype, rest)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process reading: meant
        try:
            dcp.load(tensors, storage_reader=reader, process_group=process_group, no_dist=not collective)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's gathers every rank's failures
            raise CheckpointError(f"cannot load sharded checkpoint {path}: {_reason(err)}; a shard file is damaged "
                                  "or truncated; use an earlier checkpoint") from None
    return _joined(path, tensors, rest)


def _joined(path: Any, tensors: dict, rest: dict) -> dict:
    try:
        return join(tensors, rest)
    except (CheckpointError, KeyError, TypeError, ValueError) as err:  # a state.pt of another shape
        raise CheckpointError(f"cannot load sharded checkpoint {path}: its {STATE_FILE} does not fit its shards "
                              f"({type(err).__name__}: {err}); use an earlier checkpoint") from None


def write_reason(err: BaseException, folder: Path) -> str:
    """What a failed sharded save means, in one line: a full disk (on any rank) said as such, with the space free in
    `folder`; otherwise the first rank's error."""
    causes = [getattr(cause, "exception", cause) for cause in getattr(err, "failures", {}).values()] or [err]
    for cause in causes:
        text = " ".join(str(cause).split())
        if (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)) or re.search(
                "unexpected pos|file write failed|No space left", text):
            try:
                free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free in {folder}"
            except OSError:
                free = f"in {folder}"
            return f"the disk is full or a quota was reached ({free}): free some space there or save elsewhere"
    return _reason(causes[0]) if isinstance(causes[0], BaseException) else str(causes[0])


def check_sizes(path: Any, metadata: Any) -> None:
    """CheckpointError when a tensor the metadata declares is larger than the bytes the shard files hold for it:
    reading it would first allocate its declared size (a crafted or damaged .metadata can declare terabytes)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    present: dict[str, int] = {}
    file_sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        if name not in file_sizes:
            file = Path(path) / name
            file_sizes[name] = file.stat().st_size if file.is_file() else 0
        stored = max(0, min(info.length, file_sizes[name] - info.offset))
        present[index.fqn] = present.get(index.fqn, 0) + stored
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        dims = tuple(item.size)
        if not all(isinstance(d, int) and d >= 0 for d in dims):
            raise CheckpointError(f"cannot load sharded checkpoint {path}: its .metadata gives {key} the shape "
                                  f"{dims}; use an earlier checkpoint")
        declared = math.prod(dims) * torch.empty((), dtype=item.properties.dtype).element_size()
        if declared > present.get(key, 0):
            shape = " x ".join(map(str, dims)) or "scalar"
            raise CheckpointError(
                f"cannot load sharded checkpoint {path}: its .metadata declares {key} as {shape} "
                f"{str(item.properties.dtype).replace('torch.', '')} ({_size(declared)}), but its shard files hold "
                f"{_size(present.get(key, 0))} of it (a shard file is truncated, or the metadata was damaged or "
                "edited); refused before allocating it; use an earlier checkpoint")


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} bytes"
    power = min(4, int(math.log(count, 1024)))
    return f"{count / 1024 ** power:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[power - 1]}"


def _reason(err: BaseException) -> str:
    """The last `SomeError: message` line of a (possibly multi-rank, traceback-laden) failure, else its first."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception): ", line)]
    text = errors[-1] if errors else lines[0] if lines else type(err).__name__
    first_sentence = re.match(r"(.+?)\.(\s|$)", text)
    return (first_sentence.group(1) if first_sentence else text)[:300]


def skeleton(path: Any, trust_unchecked: bool = False) -> dict:
    """The checkpoint with every tensor on the meta device (shapes only): for checks before start. The files'
    checksums are verified; no tensor is kept."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    manifest.verify(path, trust_unchecked)
    metadata = read_metadata(path)
    check_sizes(path, metadata)
    tensors: dict = {"model": {}}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            where = metadata.planner_data[key]
            node = tensors
            for part in where[:-1]:
                node = node.setdefault(part, {})
            node[where[-1]] = torch.empty(item.size, dtype=item.properties.dtype, device="meta")
    return _joined(path, tensors, read_rest(path))


def nonfinite_weights(path: Any) -> list[str]:
    """The model tensors of a verified folder holding NaN or inf, read one stored chunk at a time (any size of
    model fits in memory)."""
    import io

    metadata = read_metadata(path)
    found: list[str] = []
    for index, info in sorted(metadata.storage_data.items(), key=lambda item: (item[1].relative_path,
                                                                                 item[1].offset)):
        where = metadata.planner_data.get(index.fqn, ())
        if where[:1] != ("model",) or where[-1] in found:
            continue
        with open(Path(path) / info.relative_path, "rb") as file:
            file.seek(info.offset)
            data = file.read(info.length)
        try:
            chunk = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - bytes the checksum vouched for, or an unchecked folder's
            raise CheckpointError(f"cannot load sharded checkpoint {path}: {info.relative_path} is damaged "
                                  f"({type(err).__name__}); use an earlier checkpoint") from None
        if isinstance(chunk, torch.Tensor) and chunk.is_floating_point() and not bool(torch.isfinite(chunk).all()):
            found.append(where[-1])
    return found
