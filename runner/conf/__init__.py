"""The config groups of runner, shipped inside the package: `pkg://runner.conf` on a Hydra search path."""
