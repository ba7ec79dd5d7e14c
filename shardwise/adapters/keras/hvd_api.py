"""Horovod's ``horovod.tensorflow.keras`` functions on Keras 3 (TensorFlow backend).

The collectives are :mod:`shardwise.tensorflow`'s, so they are negotiated by name
and fail on every rank alike when ranks disagree; values go in as anything
``tf.convert_to_tensor`` takes and come back as tensors.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from ..horovod.process_sets import ProcessSet, global_process_set
from ..tensorflow import ops as tf_ops
from ..horovod.compression import Compression, Compressor
from .hvd_portable import broadcast_global_variables

__all__ = ["allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "broadcast_global_variables"]


def _constant(value: Any, name: Optional[str]) -> tf.Tensor:
    return value if isinstance(value, (tf.Tensor, tf.Variable)) else tf.constant(value, name=name)


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: type[Compressor] = Compression.none,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``value`` reduced over the ranks (default: averaged)."""
    return tf_ops.allreduce(_constant(value, name), average=average, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, op=op, compression=compression, name=name,
                            process_set=process_set)


def allgather(value: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's ``value`` concatenated along the first dimension."""
    return tf_ops.allgather(_constant(value, name), name=name, process_set=process_set)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``value`` on every rank."""
    return tf_ops.broadcast(_constant(value, name), root_rank, name=name, process_set=process_set)


def reducescatter(value: Any, name: Optional[str] = None, op: Any = tf_ops.Average,
                  process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``value`` reduced over the ranks; each rank keeps its share of the first dimension."""
    return tf_ops.reducescatter(_constant(value, name), op=op, name=name, process_set=process_set)


def alltoall(value: Any, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Block ``i`` of the first dimension goes to rank ``i``; with ``splits``, also the received splits."""
    return tf_ops.alltoall(_constant(value, name), splits=splits, name=name, process_set=process_set)
