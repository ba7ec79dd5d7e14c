"""Control requests for TensorFlow: :func:`join` and :func:`barrier` (eager, or ops in a graph).

Part of :mod:`shardwise.adapters.tensorflow.ops` (import from there).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set
from .. import requests, runtime
from ..runtime import no_autograph

__all__ = ["join", "barrier"]


# -- join, barrier --------------------------------------------------------------------------------
@no_autograph
def join() -> tf.Tensor:
    """This rank has no more data: take part in the others' allreduces with zeros until all have joined.

    Returns the rank that joined last (an int32 scalar, the same on every rank).
    """
    def run(arrays: list) -> list:
        return [np.int32(coordinator_of(global_process_set).join().wait())]

    out = runtime.call(run, [], [tf.int32], "HorovodJoin")[0]
    out.set_shape([])
    return out


@no_autograph
def barrier(process_set: ProcessSet = global_process_set) -> Optional[tf.Operation]:
    """Block until every rank of ``process_set`` reaches the barrier (an op when building a graph)."""
    request = runtime.request_name("barrier", None, [], process_set) if tf.executing_eagerly() else \
        runtime.request_name("barrier", "HorovodBarrier", [], process_set)

    def run(arrays: list) -> list:
        requests.barrier(coordinator_of(process_set), request)
        return [np.int32(0)]

    out = runtime.call(run, [], [tf.int32], "HorovodBarrier")[0]
    return None if tf.executing_eagerly() else out.op
