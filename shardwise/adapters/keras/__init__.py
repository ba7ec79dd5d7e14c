"""Keras 3 data-parallel adapter (TensorFlow, torch and JAX backends); the public face is :mod:`shardwise.keras`.

Process-level calls (``init``, ``rank``, ...) are :mod:`shardwise.adapters.horovod.basics`'s;
the collectives are :mod:`.hvd_api`'s on TensorFlow and :mod:`.hvd_portable`'s on
torch and JAX. This package holds the Keras pieces: optimizers, callbacks, the
fused gradient allreduce and the per-backend bridge to the communicator.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ...core.comm import Communicator
from . import callbacks, ops
from ..horovod.compression import Compression, Compressor
from .hooks import disable_xla
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer
from .zero.optimizer import ZeroOptimizer

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "ZeroOptimizer", "Compression", "Compressor",
           "broadcast_variables", "callbacks", "disable_xla"]


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, *,
                        comm: Optional[Communicator] = None) -> Any:
    """Overwrite ``variables`` with ``root_rank``'s values (one collective per bucket)."""
    return ops.broadcast_variables(variables, root_rank, comm=comm)
