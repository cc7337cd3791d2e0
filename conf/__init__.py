"""runner's config groups: conf/ in the repository, runner/conf/ in a wheel, the package runner.conf on either."""
