"""Horovod's TensorFlow collectives (``hvd.allreduce`` and friends) on any shardwise backend.

Every call is one named request to the process set's coordinator (see
:mod:`.requests`), run eagerly or as a graph op (see :mod:`.runtime`), on
``tf.Tensor``, ``tf.Variable`` and, for allreduce, ``tf.IndexedSlices`` (reduced by
allgathering values and indices, as Horovod does). Ranks that disagree get
``tf.errors.FailedPreconditionError`` everywhere and stay in step. Gradients are
Horovod's: an allreduce's is the allreduce of the gradient, an allgather's is this
rank's rows of the averaged gradient, a broadcast's is the averaged gradient on the
root and zero elsewhere, an alltoall's is the reverse alltoall, a reducescatter's is
the allgathered gradient (times the set size for ``Sum``).

The implementation is split by job: :mod:`.base` (argument helpers and the
differentiable dense allreduce/allgather the gradients are built from), one module
per collective (:mod:`.allreduce`, :mod:`.allgather`, :mod:`.broadcast`,
:mod:`.alltoall`, :mod:`.reducescatter`) and :mod:`.control` (join,
barrier). This module is the public namespace.
"""

from __future__ import annotations

# Names this module held before the split stay importable from it.
from shardwise.core.comm import split_sizes  # noqa: F401

from ...horovod.compression import Compression, Compressor  # noqa: F401
from ...horovod.ops import Adasum, Average, Max, Min, OpLike, Product, Sum, resolve_op  # noqa: F401
from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set  # noqa: F401
from .. import requests, runtime  # noqa: F401
from ..runtime import no_autograph  # noqa: F401
from .base import (_allgather_op, _allgather_raw, _allreduce_op, _allreduce_raw, _device,  # noqa: F401
                   _tensor, _zeros_for_none, handle_average_backwards_compatibility)
from .allgather import allgather, grouped_allgather
from .allreduce import _check_adasum, _check_sparse, _sparse_results, allreduce, grouped_allreduce  # noqa: F401
from .alltoall import _static_splits, alltoall  # noqa: F401
from .broadcast import _assign, _broadcast_raw, _is_ref, _set_root, broadcast, broadcast_  # noqa: F401
from .control import barrier, join
from .reducescatter import (_grouped_reducescatter, _reducescatter_op, grouped_reducescatter,  # noqa: F401
                            reducescatter)

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "handle_average_backwards_compatibility",
           "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
           "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier"]
