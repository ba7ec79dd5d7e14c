"""Horovod's process-level calls that do not depend on a framework (``hvd.rank()``, ``hvd.mpi_built()``, ...).

``shardwise.torch``, ``shardwise.tensorflow`` and ``shardwise.keras`` expose these
under Horovod's names; the framework modules add what is theirs (``cuda_built``,
``nccl_built``, tensor-valued ``rank_op``...).
"""

from __future__ import annotations

import atexit
import importlib.util
from typing import Any, Callable, Optional, Sequence

from ... import context
from shardwise.core.errors import ConfigError

from .process_sets import ProcessSet, add_process_set, ensure_global_coordinator, shutdown_coordinators

__all__ = ["start", "stop", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "is_homogeneous", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
           "mpi_threads_supported", "ccl_built", "ddl_built"]


def start(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None, *, backend: Optional[str] = None,
          at_exit: Optional[Callable[[], None]] = None, **options: Any) -> None:
    """What every Horovod-style ``init`` does: init shardwise, start the coordinator, add ``process_sets``.

    ``at_exit`` (the framework's ``shutdown``) is registered to run at interpreter
    exit, once. Horovod's ``comm=`` (a sub-communicator or rank list) is not supported.
    """
    if comm is not None:
        raise ConfigError("hvd.init(comm=...) is not supported by shardwise; launch only the ranks you "
                          "need, or use process sets")
    context.init(backend=backend, **options)
    if at_exit is not None:
        atexit.unregister(at_exit)
        atexit.register(at_exit)
    ensure_global_coordinator()
    for ps in process_sets or ():
        add_process_set(ps)


def stop() -> None:
    """Stop the coordinators (collective), then release the context; idempotent."""
    if context.is_initialized():
        shutdown_coordinators(context.current())
    context.shutdown()


def is_initialized() -> bool:
    """True between ``init`` and ``shutdown``."""
    return context.is_initialized()


def rank() -> int:
    """This process's rank in the world."""
    return context.current().world.rank


def size() -> int:
    """Number of processes in the world."""
    return context.current().world.size


def local_rank() -> int:
    """This process's rank on its node."""
    return context.current().local_rank


def local_size() -> int:
    """Number of processes on this node."""
    return context.current().local_size


def cross_rank() -> int:
    """The index of this process's node."""
    return context.current().cross_rank


def cross_size() -> int:
    """Number of nodes."""
    return context.current().cross_size


def is_homogeneous() -> bool:
    """True when every node runs the same number of processes."""
    ctx = context.current()
    return ctx.local_size * ctx.cross_size == ctx.world.size


def mpi_built() -> bool:
    """True when mpi4py is installed (the ``mpi`` backend can run)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True when the current backend is ``mpi``."""
    return context.current().backend == "mpi"


def gloo_built() -> bool:
    """True when ``torch.distributed`` is available (the ``torch`` backend's gloo engine)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch.distributed as dist

    return dist.is_available()


def gloo_enabled() -> bool:
    """True when the current backend is ``torch``."""
    return context.current().backend == "torch"


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
