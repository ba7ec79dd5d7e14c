"""Horovod's process-level calls for torch (``hvd.init``, ...); the framework-neutral ones are
:mod:`shardwise.adapters.horovod.basics`'s, re-exported here."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ... import context
from ...context import Context
from ..horovod.basics import (ccl_built, cross_rank, cross_size, ddl_built, gloo_built, gloo_enabled, is_homogeneous,
                              is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                              rank, size, start)
from ..horovod.process_sets import ProcessSet, registered_comms, shutdown_coordinators

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
    start(comm, process_sets, backend=backend, at_exit=shutdown, **options)


def shutdown() -> None:
    """Release the distributed context (idempotent; collective on the ``torch`` backend)."""
    if context.is_initialized():
        ctx = context.current()
        shutdown_coordinators(ctx)
        if ctx.backend == "torch" and ctx.world.size > 1:
            _stop_torch_workers(ctx)
    context.shutdown()


def abandon() -> None:
    """Leave a job that lost a rank: close the connections first, then tear down without collectives."""
    if context.is_initialized():
        ctx = context.current()
        context.abort_connections(ctx)  # peers blocked on us fail now; our coordinator thread stops on the error
        shutdown_coordinators(ctx)
    context.shutdown()


def _stop_torch_workers(ctx: Context) -> None:
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
