"""Keras 3 data-parallel adapter (TensorFlow, torch and JAX backends); the public face is :mod:`shardwise.keras`.

Process-level calls (``init``, ``rank``, ...) are :mod:`shardwise.adapters.horovod.basics`'s;
the collectives are :mod:`.hvd_api`'s on TensorFlow and :mod:`.hvd_portable`'s on
torch and JAX. This package holds the Keras pieces: the data-parallel optimizer
(:mod:`.optimizer`, with :mod:`.hooks` around ``fit``), callbacks, checkpoints,
elastic state, the fused gradient allreduce (:mod:`.ops`), and one package per concept:
:mod:`.zero` (ZeRO 1-3), :mod:`.embedding` (sharded tables), :mod:`.pipeline`
(a ``Sequential`` over ranks) and :mod:`.bridges` (the per-backend hand-over to the
communicator). It builds on :mod:`shardwise.adapters.tensorflow`, never the reverse.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ...core.comm import Communicator
from ..horovod.compression import Compression, Compressor
from . import callbacks, ops
from .hooks import disable_xla
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer
from .zero import ZeroOptimizer

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "ZeroOptimizer", "Compression", "Compressor",
           "broadcast_variables", "callbacks", "disable_xla"]


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, *,
                        comm: Optional[Communicator] = None) -> Any:
    """Overwrite ``variables`` with ``root_rank``'s values (one collective per bucket)."""
    return ops.broadcast_variables(variables, root_rank, comm=comm)
