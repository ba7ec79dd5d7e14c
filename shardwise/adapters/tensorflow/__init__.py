"""TensorFlow 2 adapter: Horovod's ``horovod.tensorflow`` API, tf.data sharding, strategy selection.

The public face is :mod:`shardwise.tensorflow`. The collectives (:mod:`.ops`) are
named requests to the process set's coordinator, run eagerly or as graph ops
(:mod:`.runtime`).
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from ...context import current
from ...core.comm import Communicator

__all__ = ["shard"]


def shard(dataset: tf.data.Dataset, *, comm: Optional[Communicator] = None) -> tf.data.Dataset:
    """This rank's share of ``dataset``: every ``size``-th element starting at ``rank``."""
    comm = comm if comm is not None else current().world
    return dataset.shard(comm.size, comm.rank)
