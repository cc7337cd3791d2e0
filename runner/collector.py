"""Python's cyclic garbage collector while a process of the command starts.

Importing torch, Lightning and the rest makes 300k-770k objects that live as long as the process. With the collector
on, each full collection during those imports walks every object made so far: about 0.65 s of a 3.6 s start on one
CPU with Lightning. And each full collection after that walks them all again, 0.2 s each (the one that frees the
loop's cycles at the end of a run among them).

So `python -m runner`, the `runner` script and each worker a launcher starts pause the collector's own collections
from their first line until the modules the config names are imported. That point is `runner.checks.validate_plan`
after `check_targets` in the command's process, the worker's `_train` once it is seeded, set up and watched (a
launched worker), or a sweep's start (its driver). There the garbage the start made is collected once, and what
lives on is frozen: moved out of the collector's sight for good, as `gc.freeze()` does for a server's forked children
(a forked worker's inheritance included). From then on the collector runs as before, so the model, the data and what
the run makes are built with it on.

The pause sets the collector's first threshold to 0 (no automatic collections) rather than turning it off: a module
that turns it off while it is imported (`gc.disable()`), or sets thresholds of its own, keeps that choice.
A program that calls the runner from Python (`runner.fit`, `runner.cli.main`) keeps its own collector as it is: only
a process the runner started pauses it.
"""

from __future__ import annotations

import gc
from typing import Optional

# The thresholds the pause replaced, while it lasts.
_paused: Optional[tuple[int, int, int]] = None


def pause() -> None:
    """No automatic collection until `resume`; at a process's first line (nothing where the collector does not
    collect by itself already)."""
    global _paused
    thresholds = gc.get_threshold()
    if gc.isenabled() and thresholds[0] and _paused is None:
        gc.set_threshold(0, *thresholds[1:])
        _paused = thresholds


def resume() -> None:
    """The start is over: its garbage is collected (0.07-0.2 s), what lives on frozen, and the collector runs as it
    did before the pause, or as the start set it. This acts once, and only after `pause`."""
    global _paused
    if _paused is None:
        return
    thresholds, _paused = _paused, None
    gc.collect()
    gc.freeze()
    if gc.get_threshold()[0] == 0:  # still the pause's: no module set thresholds of its own meanwhile
        gc.set_threshold(*thresholds)
