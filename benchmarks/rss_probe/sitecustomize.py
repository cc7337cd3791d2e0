"""Peak-memory probe: with RSS_PROBE_DIR set, every Python process records its max RSS there when it exits.

compare.py puts this folder on PYTHONPATH, so the runner, its workers, torchrun and the hand-written script
are measured the same way without changing their code.
"""

import atexit
import json
import os
import resource
import sys

_DIR = os.environ.get("RSS_PROBE_DIR")


def _record() -> None:
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    entry = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "argv": sys.argv[:3], "max_rss_mb": peak_kb / 1024}
    with open(os.path.join(_DIR, f"{os.getpid()}.json"), "w") as f:
        json.dump(entry, f)


if _DIR:
    atexit.register(_record)
