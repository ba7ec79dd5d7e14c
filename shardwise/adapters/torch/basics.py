"""Horovod's process-level calls (``hvd.init``, ``hvd.rank``, ...) over the shardwise context."""

from __future__ import annotations

import atexit
import importlib.util
from typing import Any, Optional, Sequence

import shardwise
from shardwise.core.errors import ConfigError

from ..process_sets import (ProcessSet, add_process_set, ensure_global_coordinator, registered_comms,
                            shutdown_coordinators)

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
           "rocm_built", "mpi_threads_supported", "ccl_built", "ddl_built", "is_homogeneous"]


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None, *,
         backend: Optional[str] = None, **options: Any) -> None:
    """Initialise shardwise (backend from ``backend=``, ``SHARDWISE_BACKEND`` or the launcher).

    ``process_sets`` are registered on every rank, as in Horovod. Horovod's
    ``comm=`` (a sub-communicator or rank list) is not supported. As in Horovod,
    :func:`shutdown` runs at interpreter exit.
    """
    if comm is not None:
        raise ConfigError("hvd.init(comm=...) is not supported by shardwise; launch only the ranks you "
                          "need, or use process sets")
    shardwise.init(backend=backend, **options)
    atexit.unregister(shutdown)
    atexit.register(shutdown)
    ensure_global_coordinator()
    for ps in process_sets or ():
        add_process_set(ps)


def shutdown() -> None:
    """Release the distributed context (idempotent; collective on the ``torch`` backend)."""
    if shardwise.is_initialized():
        ctx = shardwise.current()
        shutdown_coordinators(ctx)
        if ctx.backend == "torch" and ctx.world.size > 1:
            _stop_torch_workers(ctx)
    shardwise.shutdown()


def _stop_torch_workers(ctx: shardwise.Context) -> None:
    """Join the engine threads of every torch process group while Python is fully alive.

    A gloo worker thread drops a finished operation, and the Python tensors in it,
    after the waiter has woken up, and needs the GIL for that; if the interpreter
    is already finalising, torch aborts the process ("terminate called without an
    active exception"). A barrier, then ``ProcessGroup.shutdown()``, lets the
    workers finish first.
    """
    ctx.world.barrier()
    for comm in registered_comms(ctx) + [ctx.world]:
        group = getattr(comm, "process_group", None)
        stop = getattr(group, "shutdown", None)
        if stop is not None:
            try:
                stop()
            except RuntimeError:  # already shut down, or a backend without worker threads
                pass


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return shardwise.is_initialized()


def rank() -> int:
    """This process's rank in the world."""
    return shardwise.current().world.rank


def size() -> int:
    """Number of processes in the world."""
    return shardwise.current().world.size


def local_rank() -> int:
    """This process's rank on its node."""
    return shardwise.current().local_rank


def local_size() -> int:
    """Number of processes on this node."""
    return shardwise.current().local_size


def cross_rank() -> int:
    """The index of this process's node."""
    return shardwise.current().cross_rank


def cross_size() -> int:
    """Number of nodes."""
    return shardwise.current().cross_size


def mpi_built() -> bool:
    """True when mpi4py is installed (the ``mpi`` backend can run)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True when the current backend is ``mpi``."""
    return shardwise.current().backend == "mpi"


def gloo_built() -> bool:
    """True when ``torch.distributed`` is available (the ``torch`` backend's gloo engine)."""
    import torch.distributed as dist

    return dist.is_available()


def gloo_enabled() -> bool:
    """True when the current backend is ``torch``."""
    return shardwise.current().backend == "torch"


def nccl_built() -> bool:
    """True when torch has NCCL support."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def cuda_built() -> bool:
    """True when torch was built with CUDA."""
    import torch

    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """True when torch was built for ROCm."""
    import torch

    return getattr(torch.version, "hip", None) is not None


def mpi_threads_supported() -> bool:
    """True when the MPI library was initialised with full thread support."""
    if not mpi_built():
        return False
    from mpi4py import MPI

    return MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE


def ccl_built() -> bool:
    """False: shardwise has no oneCCL engine."""
    return False


def ddl_built() -> bool:
    """False: shardwise has no IBM DDL engine."""
    return False


def is_homogeneous() -> bool:
    """True when every node runs the same number of processes."""
    ctx = shardwise.current()
    return ctx.local_size * ctx.cross_size == ctx.world.size
