"""Start ``torch.distributed`` for the ``torch`` backend: under any launcher, or as an elastic job's worker."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable, Optional

from ...core.errors import BackendError
from ...core.launch_env import LaunchInfo
from .._device_binding import bind_local_device
from .._network import free_port

__all__ = ["abort_groups", "engines", "init", "init_elastic", "rendezvous_over_mpi", "store_node_layout"]


def engines() -> str:
    """The torch backend's engines: gloo, and with CUDA NCCL for CUDA tensors beside gloo for CPU ones."""
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init(launch: LaunchInfo, timeout: Optional[float] = None) -> dict[str, Any]:
    """Create the default process group (binding this rank's GPU first); returns what the context owns.

    torchrun (or ``MASTER_ADDR``) gives the rendezvous; one process uses a free local
    port; under mpirun/srun rank 0's address goes to the others over MPI.
    """
    import torch  # noqa: F401 - imported before bind_local_device looks for it
    import torch.distributed as dist

    if dist.is_initialized():
        return {}
    kwargs: dict[str, Any] = {"backend": engines()}
    if timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)
    if launch.launcher == "torchrun" or "MASTER_ADDR" in os.environ:
        os.environ.setdefault("MASTER_PORT", "29500")
        kwargs.update(init_method="env://", rank=launch.rank, world_size=launch.size)
    elif launch.size <= 1:
        kwargs.update(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    else:
        kwargs.update(init_method=rendezvous_over_mpi(), rank=launch.rank, world_size=launch.size)
    bind_local_device(launch.local_rank)
    dist.init_process_group(**kwargs)
    return {"torch_process_group": True}


def store_node_layout(store: Any, rank: int, size: int) -> tuple[int, int]:
    """(local rank, local size) of this rank from every rank's host name, exchanged through ``store``."""
    store.set(f"shardwise/host/{rank}", socket.gethostname())
    hosts = [store.get(f"shardwise/host/{r}").decode() for r in range(size)]
    local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return local.index(rank), len(local)


def init_elastic(endpoint: Any, last_generation: int, timeout: Optional[float],
                 joined: Callable[[int], None]) -> tuple[LaunchInfo, dict[str, Any]]:
    """Join the elastic job's generation after ``last_generation`` and build its gloo/NCCL group.

    ``joined`` hears the generation as soon as this worker has a place in it (so that a
    failure while wiring the group still asks for a newer one next time).

    The membership comes from the driver's secret-protected store; the group itself
    is wired through a torch ``TCPStore`` that the generation's rank 0 opens on a fresh
    port and announces through the driver's store (a store written in Python cannot
    back ``torch.distributed.new_group``, which sub-groups need).
    """
    import torch  # noqa: F401 - imported before bind_local_device looks for it
    import torch.distributed as dist

    from ..rendezvous import join

    wait = float(os.environ.get("SHARDWISE_ELASTIC_TIMEOUT", "600"))
    control = endpoint.connect(timeout=wait)
    place = join(control, endpoint.worker_id, last_generation, wait)
    joined(place.generation)
    span = datetime.timedelta(seconds=timeout if timeout is not None else wait)
    key = f"pg/{place.generation}/addr"
    if place.rank == 0:
        host = control.local_address()
        store = dist.TCPStore(host, 0, place.size, is_master=True, timeout=span, wait_for_workers=False)
        control.set(key, f"{host}:{store.port}".encode())
    else:
        host, _, port = control.get(key, timeout=wait).decode().rpartition(":")
        store = dist.TCPStore(host, int(port), place.size, is_master=False, timeout=span)
    local_rank, local_size = store_node_layout(store, place.rank, place.size)
    bind_local_device(local_rank)
    dist.init_process_group(engines(), store=store, rank=place.rank, world_size=place.size, timeout=span)
    launch = LaunchInfo("elastic", place.rank, place.size, local_rank, local_size)
    return launch, {"torch_process_group": True, "elastic": control, "elastic_generation": place.generation}


def abort_groups() -> None:
    """Close every torch process group's connections now, so that peers blocked on this rank fail fast."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    for group in list(getattr(distributed_c10d, "_world").pg_map):
        try:
            group.abort()
        except RuntimeError:
            pass


def rendezvous_over_mpi() -> str:
    """A ``tcp://`` init method: rank 0 picks an address and port; MPI tells the others (works across nodes)."""
    from ...core.launch_env import yield_mpi_waits_when_crowded

    yield_mpi_waits_when_crowded()
    try:
        from mpi4py import MPI
    except ImportError:
        raise BackendError("the torch backend under mpirun/srun needs mpi4py for its rendezvous, "
                           "or MASTER_ADDR and MASTER_PORT in the environment") from None
    comm = MPI.COMM_WORLD
    url = None
    if comm.Get_rank() == 0:
        host = os.environ.get("SHARDWISE_MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        url = f"tcp://{host}:{free_port()}"
    return comm.bcast(url, root=0)
