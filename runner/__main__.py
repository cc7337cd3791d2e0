"""`python -m runner`: see runner.cli."""

import sys

from runner import collector

collector.pause()  # until the modules the config names are imported: see runner.collector

try:
    from runner.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line's modules load: nothing has started
    print("error: interrupted by Ctrl-C: ended at once, nothing saved after the last checkpoint", file=sys.stderr)
    sys.exit(130)

main()
