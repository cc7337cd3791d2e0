"""`python -m runner`, and the `runner` script pip installs: see runner.cli."""

import sys

from runner import collector


def run() -> None:
    """The command, as the program: nothing of the user's runs after it (runner.cli.main's `program`)."""
    collector.pause()  # until the modules the config names are imported: see runner.collector
    try:
        from runner.cli import main
    except KeyboardInterrupt:  # Ctrl-C while the command line's modules load: nothing has started
        print("error: interrupted by Ctrl-C: ended at once, nothing saved after the last checkpoint", file=sys.stderr)
        sys.exit(130)
    main(program=True)


if __name__ == "__main__":
    run()
