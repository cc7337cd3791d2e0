"""The rendezvous of a job on one node: no peer node to wait for, and a store that listens on loopback alone.

torchelastic's own rendezvous (c10d, static) creates TCPStore servers, and a TCPStore server listens on every
interface whatever host name it is given: anyone who can reach the machine could read and write the job's keys.
Here the launcher binds the listening socket to 127.0.0.1 itself and hands it to the store, which serves on it.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any, Optional

BACKEND = "runner-loopback"
ADDRESS = "127.0.0.1"


def loopback_interface() -> Optional[str]:
    """The name of the loopback network interface ('lo' on Linux, 'lo0' on macOS), if there is one."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((name for name in ("lo", "lo0") if name in names), None)


def loopback_store(timeout: datetime.timedelta, **kwargs: Any) -> Any:
    """A TCPStore server on a free port of 127.0.0.1, listening there alone."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((ADDRESS, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        # The store's server (libuv) takes over the socket: detach, or Python would close it under the store.
        return dist.TCPStore(ADDRESS, port, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=listener.detach(), use_libuv=True, **kwargs)
    finally:
        listener.close()  # a no-op once detached


def _handler_class() -> type:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class LoopbackRendezvous(RendezvousHandler):
        """One node, rank 0 of 1; its workers use this store (the agent's store) to find each other."""

        def __init__(self, run_id: str, timeout: datetime.timedelta) -> None:
            self._run_id = run_id
            self._store = loopback_store(timeout, multi_tenant=True)
            self._closed = False

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> Any:
            from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

            return RendezvousInfo(self._store, 0, 1, RendezvousStoreInfo(ADDRESS, self._store.port))

        def is_closed(self) -> bool:
            return self._closed

        def set_closed(self) -> None:
            self._closed = True

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self._run_id

        def shutdown(self) -> bool:
            self._closed = True
            return True

    return LoopbackRendezvous


def _create(params: Any) -> Any:
    timeout = datetime.timedelta(seconds=params.get_as_int("timeout", 1800) or 1800)
    return _handler_class()(params.run_id, timeout)


def register() -> None:
    """Make `rdzv_backend="runner-loopback"` known to torchelastic (once per process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)
