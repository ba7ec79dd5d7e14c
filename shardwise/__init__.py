"""shardwise: framework-neutral distributed training.

Quick use::

    import shardwise
    ctx = shardwise.init()          # mpi / torch / local, detected from the launcher
    comm = ctx.world
    total = comm.allreduce(x, "sum")
"""

from .context import Context, current, init, is_initialized, shutdown
from .core.comm import Communicator, Handle, ReduceOp
from .core.errors import (BackendError, CheckpointError, CollectiveMismatchError,
                          CollectiveTimeoutError, ConfigError, DivergenceError, JobFailedError, MeshError,
                          NotInitializedError, ShapeMismatchError, ShardwiseError)
from .core.mesh import Mesh
from .core.mesh_groups import ParallelGroups, build_groups

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "current", "Context",
    "rank", "size", "local_rank", "local_size", "world",
    "Communicator", "Handle", "ReduceOp", "Mesh", "ParallelGroups", "build_groups",
    "ShardwiseError", "ConfigError", "MeshError", "BackendError", "NotInitializedError",
    "ShapeMismatchError", "CollectiveMismatchError", "CollectiveTimeoutError", "CheckpointError",
    "DivergenceError", "JobFailedError",
]


def world() -> Communicator:
    """The world communicator of the current context."""
    return current().world


def rank() -> int:
    """This process's rank in the world."""
    return current().world.rank


def size() -> int:
    """Number of processes in the world."""
    return current().world.size


def local_rank() -> int:
    """This process's rank among the processes on its node."""
    return current().local_rank


def local_size() -> int:
    """Number of processes on this node."""
    return current().local_size
