"""Cluster environments: who am I, how many of us, and where rank 0 listens."""

from runner.environments.environment import (
    ClusterEnvironment,
    LocalEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_environment,
)

__all__ = [
    "ClusterEnvironment",
    "LocalEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "detect_environment",
]
