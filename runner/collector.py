"""Python's cyclic garbage collector while a process of the command starts.

Importing torch, Lightning and the rest makes 300k-770k objects that live as long as the process. With the collector
on, each full collection during those imports walks every object made so far: about 0.5 s of a 3-4 s start on one
CPU. And each full collection after that walks them all again, 0.2 s each (the one that frees the loop's cycles at
the end of a run among them).

So `python -m runner`, and each worker a launcher starts, pause the collector from their first line until the modules
the config names are imported. That point is `runner.checks.validate_plan` after `check_targets`, the worker's
`run_from_file`, or a sweep's start for its driver. There the collector freezes what exists: moves it out of its
own sight for good, as `gc.freeze()` does for a server's forked children (a forked worker's inheritance included).
From then on it collects as usual, so the model, the data and what the run makes are built with it on.

The cost is the reference cycles that became garbage during those imports: they are kept, not freed. That is 17k
objects (1.7 MB) on the default config and 22k (11 MB) with Lightning imported; collecting them first would take the
0.2 s back. A start that made far more objects than such imports do (`COLLECT_ABOVE`) built data of its own at a
module's top level, whose cycles may be large: it collects them before the freeze, as the collector would have.

A program that calls the runner from Python (`runner.fit`, `runner.cli.main`) keeps its own collector as it is: only
a process the runner started pauses it.
"""

from __future__ import annotations

import gc

_paused = False

# The objects the imports of torch, Lightning, torchmetrics, transformers and datasets make together: 0.9M. A start
# past twice that collects before it freezes (a full collection: 0.2 s per 0.75M objects here).
COLLECT_ABOVE = 2_000_000


def pause() -> None:
    """Collect nothing until `resume`; at a process's first line (nothing when the collector is off already)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """The process's start-up made what lives on: freeze it and collect as usual from now on. This acts once, and
    only where `pause` turned the collector off."""
    global _paused
    if _paused:
        _paused = False
        if gc.get_count()[0] > COLLECT_ABOVE:  # the objects made since the pause, less those freed
            gc.collect()
        gc.freeze()
        gc.enable()
