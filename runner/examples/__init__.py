"""Example experiments for runner: model and data code, ready to run."""
