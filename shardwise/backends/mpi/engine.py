"""Start the ``mpi`` backend: MPI itself, and the torch group its device tensors may travel through."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from ...core.comm import Communicator
from ...core.errors import BackendError
from ...core.launch_env import LaunchInfo
from . import _base  # noqa: F401 - importing mpi4py.MPI starts MPI
from ._device_route import ENGINE_ENV, DeviceRoute, device_engine

__all__ = ["init", "attach_device_route"]


def init(launch: LaunchInfo, timeout: Optional[float] = None) -> dict[str, Any]:
    """Nothing left to start: importing this package ran ``MPI_Init_thread`` (mpi4py, in :mod:`._base`).

    Returns what the context owns (nothing; the world communicator is made next).
    """
    return {}


def attach_device_route(world: Communicator, timeout: Optional[float], local_size: int) -> dict[str, Any]:
    """Give the ``mpi`` world a torch group for its device tensors (see :mod:`._device_route`).

    Collective. Returns what the context then owns (the torch process group, when it made one).
    """
    if world.size <= 1 or ("torch" not in sys.modules and not os.environ.get(ENGINE_ENV, "").strip()):
        return {}
    import datetime

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    # Every rank must decide alike: a rank without CUDA, or a node with more ranks than GPUs,
    # keeps every rank on MPI.
    every = world.allgather_object((cuda, cuda and local_size > torch.cuda.device_count()))
    engine = device_engine(all(c for c, _ in every), gpus_shared=any(s for _, s in every))
    if engine is None:
        return {}
    from ..torch import TorchCommunicator
    from ..torch.engine import rendezvous_over_mpi

    owned: dict[str, Any] = {}
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": engine, "init_method": rendezvous_over_mpi(),
                                  "rank": world.rank, "world_size": world.size}
        if timeout is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout)
        dist.init_process_group(**kwargs)
        owned["torch_process_group"] = True
    elif dist.get_world_size() != world.size or dist.get_backend() != engine:
        raise BackendError(f"torch.distributed is already initialised ({dist.get_backend()}, "
                           f"{dist.get_world_size()} ranks), but the mpi backend's device tensors need a "
                           f"{engine} group over its {world.size} ranks; set {ENGINE_ENV}=off to keep them on MPI")
    world.set_device_route(DeviceRoute(TorchCommunicator(timeout=timeout), engine))  # type: ignore[attr-defined]
    owned["device_engine"] = engine
    return owned
