"""Keras 3 (TensorFlow backend) data-parallel adapter; the public face is :mod:`shardwise.keras`.

Process-level calls (``init``, ``rank``, ...) are :mod:`shardwise.adapters.hvd_basics`'s
and the collectives :mod:`shardwise.adapters.keras.hvd_api`'s; this package holds the
Keras pieces: optimizers, callbacks, the fused gradient allreduce and saving.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from ...core.comm import Communicator
from . import callbacks, ops
from .ops import Compression, Compressor
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, disable_xla
from .zero import ZeroOptimizer

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "ZeroOptimizer", "Compression", "Compressor",
           "broadcast_variables", "callbacks", "disable_xla"]


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, *,
                        comm: Optional[Communicator] = None) -> Optional[tf.Operation]:
    """Overwrite ``variables`` with ``root_rank``'s values (one collective per bucket)."""
    return ops.broadcast_variables(variables, root_rank, comm=comm)
