"""TensorFlow 2 adapter: Horovod's ``horovod.tensorflow`` API, tf.data sharding, strategy selection.

The public face is :mod:`shardwise.tensorflow`. The collectives (:mod:`.ops`) are
named requests to the process set's coordinator, run eagerly or as graph ops
(:mod:`.runtime`); importing this package sizes TensorFlow's inter-op thread pool
for them when TensorFlow has not started yet (see :func:`.runtime.reserve_inter_op_threads`).
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from ...core.comm import Communicator
from ..keras.ops import world
from . import runtime

runtime.reserve_inter_op_threads()

__all__ = ["shard"]


def shard(dataset: tf.data.Dataset, *, comm: Optional[Communicator] = None) -> tf.data.Dataset:
    """This rank's share of ``dataset``: every ``size``-th element starting at ``rank``."""
    comm = world(comm)
    return dataset.shard(comm.size, comm.rank)
