"""Images, histograms, figures and text from anywhere in a run, to whichever loggers it has.

    from runner import loggers
    loggers.log_image("val/sample", image)            # a plain module's forward, a callback's hook, a data module
    loggers.log_histogram("weights/fc1", layer.weight)
    loggers.log_figure("val/confusion", figure)       # a matplotlib figure (closed afterwards)
    loggers.log_text("val/prediction", text)

At the run's current step (the optimizer steps taken: a LightningModule's self.global_step), or at `step=`. Global
rank 0 logs, as it logs everything: the same call on other ranks, in a data loader's worker process, or outside a
run does nothing. Which loggers take what: tensorboard all four; mlflow images (an image series), figures and text
as artifacts, histograms as a JSON artifact of bins and counts; wandb all four; csv none (it keeps scalars). The
trackers share the conversions below (`hwc_array`, `histogram`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Optional

# The run in progress in this process: its logger (rank 0's, or one that does nothing), its step, and its process.
_runs: list[tuple[Any, Callable[[], int], int]] = []


@contextlib.contextmanager
def active(logger: Any, step: Callable[[], int]) -> Iterator[None]:
    """While a stage runs: the media functions log to `logger`, at `step()` unless told."""
    _runs.append((logger, step, os.getpid()))
    try:
        yield
    finally:
        _runs.pop()


def log_image(name: str, image: Any, step: Optional[int] = None, dataformats: str = "CHW") -> None:
    """An image: a tensor or array of shape CHW (C: 1, 3 or 4; float in [0, 1] or uint8), or HWC / HW as
    `dataformats` says."""
    _send("log_image", name, image, step, dataformats=dataformats)


def log_histogram(name: str, values: Any, step: Optional[int] = None) -> None:
    """The distribution of `values` (a tensor or array of any shape)."""
    _send("log_histogram", name, values, step)


def log_figure(name: str, figure: Any, step: Optional[int] = None, close: bool = True) -> None:
    """A matplotlib figure; closed afterwards unless `close=False`."""
    try:
        _send("log_figure", name, figure, step)
    finally:
        if close:
            import matplotlib.pyplot as plt

            plt.close(figure)


def log_text(name: str, text: str, step: Optional[int] = None) -> None:
    """A piece of text (markdown in TensorBoard)."""
    _send("log_text", name, str(text), step)


def _send(method: str, name: str, value: Any, step: Optional[int], **settings: Any) -> None:
    if not _runs or _runs[-1][2] != os.getpid():  # no run here: a notebook, or a forked loader worker
        return
    logger, current, _ = _runs[-1]
    found = getattr(logger, method, None)
    if found is not None:  # a user's logger may not take media
        found(str(name), value, current() if step is None else int(step), **settings)


def hwc_array(image: Any, dataformats: str = "CHW") -> Any:
    """`image` (a tensor or array laid out as `dataformats`: CHW, HWC or HW) as a numpy array of height, width and
    channels, as MLflow's and W&B's image APIs take it."""
    import numpy as np

    array = image.detach().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
    layout = dataformats.upper()
    if sorted(layout) not in (sorted("CHW"), sorted("HW")) or array.ndim != len(layout):
        raise ValueError(f"log_image: an image of shape {tuple(array.shape)} is not laid out as dataformats="
                         f"{dataformats!r}; use CHW, HWC or HW")
    if layout == "HW":
        return array[:, :, None]
    return np.transpose(array, [layout.index(axis) for axis in "HWC"])


def histogram(values: Any, bins: int = 64) -> tuple[list, list]:
    """(counts, bin edges) of `values` (a tensor or array of any shape), as plain lists."""
    import numpy as np

    array = values.detach().float().cpu().numpy() if hasattr(values, "detach") else np.asarray(values, dtype=float)
    counts, edges = np.histogram(array.reshape(-1), bins=bins)
    return counts.tolist(), edges.tolist()
