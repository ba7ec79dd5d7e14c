"""Horovod's tensor collectives for torch (``hvd.allreduce`` and friends) on any shardwise backend.

Every call is a named request to the process set's
:class:`~shardwise.adapters.horovod.coordinator.Coordinator`, which matches it with the
other ranks' by name, checks that they agree (shapes, dtypes, op, root, ...) and
runs it; a disagreement raises the same error on every rank and the ranks stay in
step. Out-of-place calls are differentiable like Horovod's (the backward of an
allreduce is an allreduce of the gradient, and so on). ``*_async`` calls return
an :class:`AsyncHandle` for :func:`synchronize` and :func:`poll`; ``grouped_*``
calls move a list of tensors as one request.

The implementation is split by job: :mod:`.handles` (async handles),
:mod:`.requests` (request plumbing), one module per collective
(:mod:`.allreduce`, :mod:`.allgather` with the sparse allreduce,
:mod:`.broadcast`, :mod:`.alltoall`, :mod:`.reducescatter`) and
:mod:`.control` (barrier, join). This module is the public namespace.
"""

from __future__ import annotations

# Names this module held before the split stay importable from it.
from shardwise.core.comm import Communicator, ReduceOp  # noqa: F401
from shardwise.core.negotiation import RequestMeta, Response  # noqa: F401

from ...horovod.coordinator import Coordinator, Future  # noqa: F401
from ...horovod.ops import Adasum, Average, Max, Min, OpLike, Product, Sum, resolve_op  # noqa: F401
from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set  # noqa: F401
from ..compression import Compression, Compressor  # noqa: F401
from .allgather import (_allgather_submit, _GroupedAllgatherFn, _rows_of, allgather,  # noqa: F401
                        allgather_async, grouped_allgather, grouped_allgather_async, sparse_allreduce_async)
from .allreduce import (_adasum_executor, _allreduce_submit, _GroupedAllreduceFn, allreduce,  # noqa: F401
                        allreduce_, allreduce_async, allreduce_async_, grouped_allreduce, grouped_allreduce_,
                        grouped_allreduce_async, grouped_allreduce_async_)
from .alltoall import _alltoall_submit, _AlltoallFn, _check_splits, alltoall, alltoall_async  # noqa: F401
from .broadcast import (_broadcast_submit, _BroadcastFn, broadcast, broadcast_, broadcast_async,  # noqa: F401
                        broadcast_async_)
from .control import barrier, join
from .handles import AsyncHandle, poll, synchronize
from .reducescatter import (_GroupedReducescatterFn, _reducescatter_submit, grouped_reducescatter,  # noqa: F401
                            grouped_reducescatter_async, reducescatter, reducescatter_async)
from .requests import _device, _dtype, _scale, _set_relative_root, _spec, _submit  # noqa: F401

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "AsyncHandle", "resolve_op",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
           "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async",
           "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
           "sparse_allreduce_async", "synchronize", "poll", "barrier", "join"]
