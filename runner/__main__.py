"""`python -m runner`: see runner.cli."""

from runner.cli import main

main()
