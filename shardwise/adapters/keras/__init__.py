"""Keras 3 (TensorFlow backend) data-parallel adapter; the public face is :mod:`shardwise.keras`."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from ... import context as _context
from ...core.comm import Communicator, ReduceOp
from ...core.errors import ConfigError
from . import callbacks, ops
from .ops import Compression, Compressor
from .optimizer import DistributedOptimizer, disable_xla
from .zero import ZeroOptimizer

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "DistributedOptimizer",
           "ZeroOptimizer", "Compression", "allreduce", "allgather", "broadcast", "broadcast_variables",
           "callbacks", "disable_xla"]


def init(backend: Optional[str] = None, **kwargs: Any) -> _context.Context:
    """Initialise shardwise (``mpi`` under mpirun, ``local`` for one process); idempotent."""
    return _context.init(backend=backend, **kwargs)


def shutdown() -> None:
    """Release the shardwise context."""
    _context.shutdown()


def rank() -> int:
    """This process's rank."""
    return _context.current().world.rank


def size() -> int:
    """Number of processes."""
    return _context.current().world.size


def local_rank() -> int:
    """This process's rank on its node."""
    return _context.current().local_rank


def local_size() -> int:
    """Number of processes on this node."""
    return _context.current().local_size


def _op(average: Optional[bool], op: Optional[ReduceOp | str]) -> ReduceOp:
    if op is not None and average is not None:
        raise ConfigError("pass either average= or op=, not both")
    if op is not None:
        return ReduceOp.parse(op)
    return ReduceOp.SUM if average is False else ReduceOp.AVERAGE


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              op: Optional[ReduceOp | str] = None, compression: type[Compressor] = Compression.none, *,
              comm: Optional[Communicator] = None) -> tf.Tensor:
    """Average (default) or reduce ``value`` over ranks; returns a tensor. ``name`` is accepted for Horovod compatibility."""
    return ops.allreduce(value, _op(average, op), comm=comm, compression=compression)


def allgather(value: Any, name: Optional[str] = None, *, comm: Optional[Communicator] = None) -> tf.Tensor:
    """Concatenate every rank's ``value`` along dim 0."""
    return ops.allgather(value, comm=comm)


def broadcast(value: Any, root_rank: int = 0, name: Optional[str] = None, *,
              comm: Optional[Communicator] = None) -> tf.Tensor:
    """``root_rank``'s ``value`` on every rank."""
    return ops.broadcast(value, root_rank, comm=comm)


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, *,
                        comm: Optional[Communicator] = None) -> Optional[tf.Operation]:
    """Overwrite ``variables`` with ``root_rank``'s values (one collective per bucket)."""
    return ops.broadcast_variables(variables, root_rank, comm=comm)
