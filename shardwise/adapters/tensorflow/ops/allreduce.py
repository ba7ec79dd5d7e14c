"""allreduce for TensorFlow: dense tensors as one request, ``tf.IndexedSlices`` by allgathers.

Part of :mod:`shardwise.adapters.tensorflow.ops` (import from there).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from ...horovod.compression import Compression, Compressor
from ...horovod.ops import Adasum, Average, OpLike, Sum
from ...horovod.process_sets import ProcessSet, global_process_set
from .allgather import grouped_allgather
from .base import _allreduce_op, _device, _tensor, handle_average_backwards_compatibility
from ..runtime import no_autograph

__all__ = ["allreduce", "grouped_allreduce"]


# -- allreduce ------------------------------------------------------------------------------------
def _check_adasum(process_set: ProcessSet) -> None:
    if not process_set.is_global():
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    n = process_set.size()
    if n & (n - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")


def _check_sparse(op: Any, prescale: float, postscale: float) -> None:
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. As a "
                                  "workaround please pass sparse_as_dense=True to DistributedOptimizer")
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _sparse_results(slices: list[tf.IndexedSlices], op: Any, process_set: ProcessSet,
                    ignore_name_scope: bool) -> list[tf.IndexedSlices]:
    values = grouped_allgather([s.values for s in slices], process_set=process_set,
                               ignore_name_scope=ignore_name_scope)
    indices = grouped_allgather([s.indices for s in slices], process_set=process_set,
                                ignore_name_scope=ignore_name_scope)
    if op is Average:
        values = [v / tf.cast(process_set.size(), v.dtype) for v in values]
    return [tf.IndexedSlices(v, i, dense_shape=s.dense_shape) for v, i, s in zip(values, indices, slices)]


@no_autograph
def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression: type[Compressor] = Compression.none, op: Optional[OpLike] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False) -> Any:
    """``tensor`` reduced over the process set (default ``Average``); ``tf.IndexedSlices`` stay sparse."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op, prescale_factor,
                             postscale_factor, process_set, ignore_name_scope, name)[0]


@no_autograph
def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression: type[Compressor] = Compression.none,
                      op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                      name: Optional[str] = None) -> list[Any]:
    """Reduce each of ``tensors``: the dense ones as one request, the ``IndexedSlices`` by allgathers."""
    if not tensors:
        return list(tensors)
    op = handle_average_backwards_compatibility(op, average)
    results: list[Any] = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
        with _device(device_sparse):
            for i, out in zip(sparse, _sparse_results([tensors[i] for i in sparse], op, process_set,
                                                      ignore_name_scope)):
                results[i] = out
    if dense:
        if op == Adasum:
            _check_adasum(process_set)
        with _device(device_dense):
            packed = [compression.compress(_tensor(tensors[i])) for i in dense]
            outs = _allreduce_op([w for w, _ in packed], op, float(prescale_factor), float(postscale_factor),
                                 name, process_set, ignore_name_scope)
            for i, out, (_, ctx) in zip(dense, outs, packed):
                results[i] = compression.decompress(out, ctx)
    return results
