"""`python -m runner`: see runner.cli."""

import sys

try:
    from runner.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line's modules load: nothing has started
    print("error: interrupted by Ctrl-C: ended at once, nothing saved after the last checkpoint", file=sys.stderr)
    sys.exit(130)

main()
