"""Example experiments for runner, model and data code ready to run: experiments/ in the repository,
runner/examples/ in a wheel, the package runner.examples (`_target_: runner.examples.shapes.SmallCNN`)."""
