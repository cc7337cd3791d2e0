"""A callback whose module hangs while rank 1 of a launched job imports it, as one waiting on a network file system's
lock or a download at import would (test_stall_before_first_step)."""

import os
import time

if os.environ.get("RANK") == "1":
    time.sleep(3600)


class Quiet:
    def on_fit_start(self, loop: object) -> None:
        pass
