"""TensorFlow 2 data-parallel adapter: DistributedGradientTape, tf.data sharding, strategy selection.

The public face is :mod:`shardwise.tensorflow`. Collectives come from
:mod:`shardwise.adapters.keras.ops`, so they work eagerly and inside ``tf.function``.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from ...core.buckets import DEFAULT_BUCKET_CAP_BYTES
from ...core.comm import Communicator, ReduceOp
from ...core.errors import ConfigError
from ..keras import (allgather, allreduce, broadcast, broadcast_variables, init, local_rank,
                     local_size, rank, shutdown, size)
from ..keras.ops import Compression, Compressor, allreduce_gradients, world
from .strategy import Detection, StrategyChoice, choose_strategy, detect, strategy, tf_config

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "allreduce", "allgather",
           "broadcast", "broadcast_variables", "Compression", "DistributedGradientTape", "shard",
           "strategy", "choose_strategy", "detect", "Detection", "StrategyChoice", "tf_config"]


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape`` so that :meth:`gradient` returns gradients averaged over ranks.

    Use it after recording (``tape = DistributedGradientTape(tape)``) or as the
    recording context itself; every other attribute is the wrapped tape's.
    """

    def __init__(self, tape: tf.GradientTape, compression: type[Compressor] = Compression.none, *,
                 op: ReduceOp | str = ReduceOp.AVERAGE, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 comm: Optional[Communicator] = None) -> None:
        if not isinstance(tape, tf.GradientTape):
            raise ConfigError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(tape).__name__}")
        self._tape = tape
        self._compression = compression
        self._op = ReduceOp.parse(op)
        self._cap = int(bucket_cap_bytes)
        self._comm = comm

    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        if name == "_tape":
            raise AttributeError(name)
        return getattr(self._tape, name)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any) -> Any:
        """The wrapped tape's gradients, reduced over ranks (same nesting; ``None`` kept)."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        reduced = allreduce_gradients(flat, comm=world(self._comm), op=self._op,
                                      compression=self._compression, cap_bytes=self._cap)
        return tf.nest.pack_sequence_as(grads, reduced)


def shard(dataset: tf.data.Dataset, *, comm: Optional[Communicator] = None) -> tf.data.Dataset:
    """This rank's share of ``dataset``: every ``size``-th element starting at ``rank``."""
    comm = world(comm)
    return dataset.shard(comm.size, comm.rank)
