"""Cluster environments read rank, world size and the rank-0 address from where the processes came from."""

from __future__ import annotations

import os
import re


class ClusterEnvironment:
    """Where the processes of a job come from. Rank getters read the environment each time they are called."""

    # True when something outside the runner (torchrun, srun) already created every process.
    creates_processes_externally: bool = False

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", 0))

    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", 1))

    def global_rank(self) -> int:
        return int(os.environ.get("RANK", 0))

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)))

    @staticmethod
    def detect() -> bool:
        return False

    def validate_settings(self, num_devices: int, num_nodes: int) -> list[str]:
        """Problems with `trainer.devices`/`trainer.num_nodes` in this environment, as user-facing messages."""
        return []


class LocalEnvironment(ClusterEnvironment):
    """One machine; the runner starts `trainer.devices` processes itself (RANK etc. are set by its launcher)."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> list[str]:
        if num_nodes != 1:
            return [
                f"trainer.num_nodes={num_nodes} needs processes started by a cluster (cluster=torchelastic via "
                "torchrun, or cluster=slurm via srun); cluster=local runs on one node (use trainer.num_nodes=1)"
            ]
        return []


def _external_size_problems(name: str, env_world: int, num_devices: int, num_nodes: int) -> list[str]:
    expected = num_devices * num_nodes
    if env_world != expected:
        return [
            f"trainer.devices={num_devices} x trainer.num_nodes={num_nodes} = {expected} processes, but {name} "
            f"started {env_world}; set trainer.devices to the processes per node and trainer.num_nodes to the nodes"
        ]
    return []


class TorchElasticEnvironment(ClusterEnvironment):
    """Processes started by torchrun (torch.distributed.elastic): it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*."""

    creates_processes_externally = True

    @staticmethod
    def detect() -> bool:
        required = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
        return all(key in os.environ for key in required)

    def validate_settings(self, num_devices: int, num_nodes: int) -> list[str]:
        if not self.detect():
            return ["cluster=torchelastic but this process was not started by torchrun (RANK, WORLD_SIZE, "
                    "MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID are not all set); use cluster=auto or local"]
        return _external_size_problems("torchrun", self.world_size(), num_devices, num_nodes)


class SLURMEnvironment(ClusterEnvironment):
    """Processes started by `srun`: one task per device, rank-0 address taken from the job's node list."""

    creates_processes_externally = True

    @staticmethod
    def detect() -> bool:
        # An interactive allocation (salloc, `srun --pty bash`) is a shell, not a job of ours.
        return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        nodes = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", "127.0.0.1"))
        return first_hostname(nodes)

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        # Every task derives the same port from the job id, so no task needs to ask another.
        job_id = int(os.environ.get("SLURM_JOB_ID", "0"))
        return 20000 + job_id % 20000

    # Defaults stand for "not under srun", which validate_settings reports.
    def world_size(self) -> int:
        return int(os.environ.get("SLURM_NTASKS", 1))

    def global_rank(self) -> int:
        return int(os.environ.get("SLURM_PROCID", 0))

    def local_rank(self) -> int:
        return int(os.environ.get("SLURM_LOCALID", 0))

    def node_rank(self) -> int:
        return int(os.environ.get("SLURM_NODEID", 0))

    def validate_settings(self, num_devices: int, num_nodes: int) -> list[str]:
        if not all(key in os.environ for key in ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")):
            return ["cluster=slurm but this process was not started by srun (SLURM_NTASKS, SLURM_PROCID, "
                    "SLURM_LOCALID are not all set); use cluster=auto or local"]
        return _external_size_problems("srun", self.world_size(), num_devices, num_nodes)


def first_hostname(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,7],cpu1' -> 'gpu003'."""
    match = re.match(r"([^,\[]+)(\[([^\]]*)\])?", nodelist.strip())
    if match is None:
        return "127.0.0.1"
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_environment() -> ClusterEnvironment:
    """`cluster=auto`: torchrun's variables, then SLURM's, else a local run."""
    for env_class in (TorchElasticEnvironment, SLURMEnvironment):
        if env_class.detect():
            return env_class()
    return LocalEnvironment()
