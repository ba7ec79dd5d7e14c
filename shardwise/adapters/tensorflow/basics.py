"""Horovod's process-level calls for TensorFlow: ``hvd.init``, build queries and the ``*_op`` tensors.

The framework-neutral calls come from :mod:`shardwise.adapters.horovod.basics`. The
``rank_op``/``size_op`` family returns int32 scalars whose value is read when the op
runs (as Horovod's ops do), so a graph can be built before ``init``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from ... import context

from ..horovod import basics as hvd_basics
from ..horovod.process_sets import ProcessSet, process_set_by_id
from .runtime import no_autograph

__all__ = ["init", "shutdown", "nccl_built", "cuda_built", "rocm_built", "rank_op", "local_rank_op", "size_op",
           "local_size_op", "process_set_included_op", "PROCESS_SET_ERROR_INIT", "PROCESS_SET_ERROR_UNKNOWN_SET"]

#: ``process_set_included_op`` values when shardwise is not initialised / the id is not registered (Horovod's).
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None, *,
         backend: Optional[str] = None, **options: Any) -> None:
    """Initialise shardwise (backend from ``backend=``, ``SHARDWISE_BACKEND`` or the launcher).

    ``process_sets`` are registered on every rank, as in Horovod; :func:`shutdown`
    runs at interpreter exit.
    """
    hvd_basics.start(comm, process_sets, backend=backend, at_exit=shutdown, **options)


def shutdown() -> None:
    """Release the distributed context (idempotent)."""
    hvd_basics.stop()


def nccl_built() -> int:
    """0: the TensorFlow ops run over shardwise's engines, not NCCL (Horovod returns NCCL's version)."""
    return 0


def cuda_built() -> bool:
    """True when TensorFlow was built with CUDA."""
    return tf.test.is_built_with_cuda()


def rocm_built() -> bool:
    """True when TensorFlow was built for ROCm."""
    return tf.test.is_built_with_rocm()


def _int_op(value: Callable[[], int], name: Optional[str], default: str) -> tf.Tensor:
    """An int32 scalar holding ``value()``: now when eager, when the op runs in a graph."""
    if tf.executing_eagerly():
        return tf.constant(value(), tf.int32)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=False, name=name or default)
    out.set_shape([])
    return out


@no_autograph
def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank, as an int32 tensor."""
    return _int_op(hvd_basics.rank, name, "HorovodRank")


@no_autograph
def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its node, as an int32 tensor."""
    return _int_op(hvd_basics.local_rank, name, "HorovodLocalRank")


@no_autograph
def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """Number of processes on this node, as an int32 tensor."""
    return _int_op(hvd_basics.local_size, name, "HorovodLocalSize")


@no_autograph
def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """Number of processes in the process set with this id (0: the world), as an int32 tensor."""
    def value() -> int:
        ps = process_set_by_id(process_set_id)
        if ps is None:
            raise ValueError(f"no process set with id {process_set_id} is registered")
        return ps.size()

    return _int_op(value, name, "HorovodSize")


@no_autograph
def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this process is in the set with this id, 0 if not; Horovod's negative codes for errors."""
    def value() -> int:
        if not context.is_initialized():
            return PROCESS_SET_ERROR_INIT
        ps = process_set_by_id(process_set_id)
        return PROCESS_SET_ERROR_UNKNOWN_SET if ps is None else int(ps.included())

    return _int_op(value, name, "HorovodProcessSetIncluded")
