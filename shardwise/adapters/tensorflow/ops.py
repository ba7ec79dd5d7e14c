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
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from shardwise.core.comm import split_sizes

from ..keras.compression import Compression, Compressor
from ..hvd_ops import Adasum, Average, Max, Min, OpLike, Product, Sum, resolve_op
from ..process_sets import ProcessSet, coordinator_of, global_process_set
from . import requests, runtime
from .runtime import no_autograph

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "handle_average_backwards_compatibility",
           "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
           "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier"]

def handle_average_backwards_compatibility(op: Optional[OpLike], average: Optional[bool]) -> Any:
    """Horovod's ``op``/deprecated ``average`` arguments as one op (default ``Average``)."""
    return resolve_op(op, average)


def _tensor(value: Any) -> tf.Tensor:
    return value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(value)


def _zeros_for_none(grads: Sequence[Optional[tf.Tensor]], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    return [tf.zeros_like(x) if g is None else g for g, x in zip(grads, like)]


def _device(name: str) -> Any:
    """Horovod's ``device_dense``/``device_sparse``: a device scope, or none for ``""``."""
    return tf.device(name) if name else contextlib.nullcontext()


# -- allreduce ------------------------------------------------------------------------------------
def _allreduce_raw(tensors: list[tf.Tensor], op: Any, prescale: float, postscale: float, name: Optional[str],
                   process_set: ProcessSet, ignore_name_scope: bool) -> list[tf.Tensor]:
    request = runtime.request_name("allreduce", name, tensors, process_set, ignore_name_scope)
    device = runtime.device_of(tensors[0])

    def run(arrays: list) -> list:
        return requests.allreduce(coordinator_of(process_set), request, arrays, op, prescale, postscale, device)

    outs = runtime.call(run, tensors, [t.dtype for t in tensors], "HorovodAllreduce")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


def _allreduce_op(tensors: list[tf.Tensor], op: Any, prescale: float, postscale: float, name: Optional[str],
                  process_set: ProcessSet, ignore_name_scope: bool) -> list[tf.Tensor]:
    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        outs = _allreduce_raw(list(xs), op, prescale, postscale, name, process_set, ignore_name_scope)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return _allreduce_op(_zeros_for_none(dys, outs), op, prescale, postscale, None, process_set,
                                 ignore_name_scope)

        return outs, grad

    return list(forward(*tensors))


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


# -- allgather ------------------------------------------------------------------------------------
def _allgather_raw(tensors: list[tf.Tensor], name: Optional[str], process_set: ProcessSet,
                   ignore_name_scope: bool) -> list[tf.Tensor]:
    for t in tensors:
        if t.shape.rank == 0:
            raise runtime.invalid_argument("allgather needs tensors of at least one dimension, got a scalar")
    request = runtime.request_name("allgather", name, tensors, process_set, ignore_name_scope)
    device = runtime.device_of(tensors[0])

    def run(arrays: list) -> list:
        return requests.allgather(coordinator_of(process_set), request, arrays, device)

    outs = runtime.call(run, tensors, [t.dtype for t in tensors], "HorovodAllgather")
    for out, t in zip(outs, tensors):
        if t.shape.rank is not None:
            out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return outs


def _allgather_op(tensors: list[tf.Tensor], name: Optional[str], process_set: ProcessSet,
                  ignore_name_scope: bool) -> list[tf.Tensor]:
    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        outs = _allgather_raw(list(xs), name, process_set, ignore_name_scope)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            reduced = _allreduce_op(_zeros_for_none(dys, outs), Average, 1.0, 1.0, None, process_set,
                                    ignore_name_scope)
            with tf.device("/cpu:0"):
                mine = tf.stack([tf.shape(x, out_type=tf.int32)[0] for x in xs])
                every = tf.reshape(_allgather_raw([mine], None, process_set, ignore_name_scope)[0],
                                   [process_set.size(), len(xs)])
                offsets = tf.reduce_sum(every[:process_set.rank()], axis=0)
            grads = []
            for j, (g, x) in enumerate(zip(reduced, xs)):
                piece = g[offsets[j]:offsets[j] + mine[j]]
                piece.set_shape(x.shape)
                grads.append(piece)
            return grads

        return outs, grad

    return list(forward(*tensors))


@no_autograph
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 (first dimensions may differ)."""
    return _allgather_op([_tensor(tensor)], name, process_set, ignore_name_scope)[0]


@no_autograph
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather each of ``tensors``, as one request."""
    if not tensors:
        return list(tensors)
    return _allgather_op([_tensor(t) for t in tensors], name, process_set, ignore_name_scope)


# -- broadcast ------------------------------------------------------------------------------------
def _set_root(root_rank: int, process_set: ProcessSet) -> int:
    """A world rank as the set's rank; a rank outside the set becomes a negative, rejected by negotiation."""
    if process_set.is_global():
        return int(root_rank)
    ranks = process_set.ranks
    return ranks.index(int(root_rank)) if int(root_rank) in ranks else -1 - int(root_rank)


def _broadcast_raw(tensors: list[tf.Tensor], root_rank: int, name: Optional[str], process_set: ProcessSet,
                   ignore_name_scope: bool, prefix: Optional[str] = None) -> list[tf.Tensor]:
    request = runtime.request_name("broadcast", name, tensors, process_set, ignore_name_scope, prefix)
    device, root = runtime.device_of(tensors[0]), _set_root(root_rank, process_set)

    def run(arrays: list) -> list:
        return requests.broadcast(coordinator_of(process_set), request, arrays, root, device)

    outs = runtime.call(run, tensors, [t.dtype for t in tensors], "HorovodBroadcast")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


@no_autograph
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` (a world rank) on every rank of the set."""
    root_rank = int(root_rank)

    @tf.custom_gradient
    def forward(x: tf.Tensor) -> Any:
        out = _broadcast_raw([x], root_rank, name, process_set, ignore_name_scope)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            reduced = _allreduce_op(_zeros_for_none([dy], [out]), Average, 1.0, 1.0, None, process_set,
                                    ignore_name_scope)[0]
            # The same ops on every rank, so that the names of later collectives in the graph agree.
            keep = float(coordinator_of(process_set).comm.rank == _set_root(root_rank, process_set))
            return reduced * tf.cast(keep, reduced.dtype)

        return out, grad

    return forward(_tensor(tensor))


def _is_ref(var: Any) -> bool:
    """True for a TF1 reference variable (``RefVariable``), which assigns through ``tf.compat.v1.assign``."""
    try:
        from tensorflow.python.ops.ref_variable import RefVariable
    except ImportError:  # TF < 2.13
        from tensorflow.python.ops.variables import RefVariable
    return isinstance(var, RefVariable)


def _assign(var: Any, value: tf.Tensor) -> tf.Tensor:
    """Write ``value`` into ``var`` and return the variable's new value."""
    if tf.executing_eagerly():
        var.assign(value)
        return tf.convert_to_tensor(var)
    if _is_ref(var):
        return tf.identity(tf.compat.v1.assign(var, value))
    if isinstance(var, tf.Variable):
        with tf.control_dependencies([var.assign(value, read_value=False)]):
            return tf.identity(var.read_value())
    var.assign(value)  # a Keras variable: tf.function orders the read after it (automatic control deps)
    return tf.convert_to_tensor(var)


@no_autograph
def broadcast_(variables: Sequence[Any], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Overwrite ``variables`` with ``root_rank``'s values (one request); returns their new values."""
    variables = list(variables)
    if not variables:
        return []
    kinds = {_is_ref(v) for v in variables}
    if len(kinds) > 1:
        raise ValueError("All variables passed to broadcast_() should be of the same kind, resource or reference")
    values = [tf.convert_to_tensor(v) for v in variables]
    outs = _broadcast_raw(values, int(root_rank), name, process_set, False, prefix="HorovodBroadcastInplace")
    return [_assign(v, o) for v, o in zip(variables, outs)]


# -- alltoall -------------------------------------------------------------------------------------
def _static_splits(tensor: tf.Tensor, splits: Optional[tf.Tensor], size: int) -> None:
    """Raise InvalidArgument now for split errors visible while building the op."""
    if splits is not None and not splits.dtype.is_integer:
        raise runtime.invalid_argument(f"alltoall splits must be integers, got {splits.dtype.name}")
    rows = tensor.shape[0] if tensor.shape.rank else None
    if tensor.shape.rank == 0:
        rows = None
    elif rows is None:
        return
    known = None if splits is None else tf.get_static_value(splits)
    if splits is not None and known is None:
        return
    try:
        requests.check_splits(rows, None if known is None else known.reshape(-1).tolist(), size)
    except ValueError as exc:
        raise runtime.invalid_argument(str(exc)) from None


@no_autograph
def alltoall(tensor: Any, splits: Optional[Any] = None, name: Optional[str] = None,
             ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of dim 0 to set rank ``i`` (equal blocks without ``splits``).

    With ``splits``, returns ``(output, received_splits)``; without, the output only.
    """
    tensor = _tensor(tensor)
    size = process_set.size()
    split_t = None if splits is None else _tensor(splits)
    _static_splits(tensor, split_t, size)
    inputs = [tensor] + ([tf.cast(split_t, tf.int64)] if split_t is not None else [])

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        request = runtime.request_name("alltoall", name, xs[:1], process_set, ignore_name_scope)
        device = runtime.device_of(xs[0])

        def run(arrays: list) -> list:
            sent = arrays[1].reshape(-1).tolist() if len(arrays) > 1 else None
            return list(requests.alltoall(coordinator_of(process_set), request, arrays[0], sent, device))

        out, received = runtime.call(run, list(xs), [xs[0].dtype, tf.int32], "HorovodAlltoall")
        if xs[0].shape.rank is not None:
            out.set_shape(tf.TensorShape([None]).concatenate(xs[0].shape[1:]))
        received.set_shape([size])

        def grad(dy: tf.Tensor, _d_received: Any = None) -> list:
            back, _ = alltoall(_zeros_for_none([dy], [out])[0], received, ignore_name_scope=ignore_name_scope,
                               process_set=process_set)
            return [back] + [None] * (len(xs) - 1)

        return [out, received], grad

    out, received = forward(*inputs)
    return (out, received) if splits is not None else out


# -- reducescatter --------------------------------------------------------------------------------
def _reducescatter_op(tensors: list[tf.Tensor], op: Any, prescale: float, postscale: float,
                      name: Optional[str], process_set: ProcessSet, ignore_name_scope: bool) -> list[tf.Tensor]:
    for t in tensors:
        if t.shape.rank == 0:
            raise runtime.invalid_argument("reducescatter needs tensors of at least one dimension, got a scalar")
    if op == Adasum:
        raise NotImplementedError("reducescatter does not support op=Adasum")
    size, me = process_set.size(), process_set.rank()

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        request = runtime.request_name("reducescatter", name, xs, process_set, ignore_name_scope)
        device = runtime.device_of(xs[0])

        def run(arrays: list) -> list:
            return requests.reducescatter(coordinator_of(process_set), request, arrays, op, prescale, postscale,
                                          device)

        outs = runtime.call(run, list(xs), [x.dtype for x in xs], "HorovodReducescatter")
        for out, x in zip(outs, xs):
            if x.shape.rank is not None:
                rows = x.shape[0]
                out.set_shape(tf.TensorShape([None if rows is None else split_sizes(rows, size)[me]])
                              .concatenate(x.shape[1:]))

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            factor = (size if op is Sum else 1) * prescale * postscale
            dys = [g * tf.cast(factor, g.dtype) if factor != 1 else g for g in _zeros_for_none(dys, outs)]
            return _allgather_op(dys, None, process_set, ignore_name_scope)

        return outs, grad

    return list(forward(*tensors))


@no_autograph
def reducescatter(tensor: Any, device_dense: str = "", compression: type[Compressor] = Compression.none,
                  op: OpLike = Average, name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over the set (default ``Average``), keep this rank's rows of dim 0 (lowest ranks get extras)."""
    return _grouped_reducescatter([tensor], device_dense, compression, op, name, process_set, ignore_name_scope,
                                  prescale_factor, postscale_factor)[0]


@no_autograph
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none, op: OpLike = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """Reducescatter each of ``tensors``, as one request."""
    return _grouped_reducescatter(tensors, device_dense, compression, op, None, process_set, False,
                                  prescale_factor, postscale_factor)


def _grouped_reducescatter(tensors: Sequence[Any], device_dense: str, compression: type[Compressor], op: Any,
                           name: Optional[str], process_set: ProcessSet, ignore_name_scope: bool,
                           prescale: float, postscale: float) -> list[tf.Tensor]:
    if not tensors:
        return list(tensors)
    op = handle_average_backwards_compatibility(op, None)
    with _device(device_dense):
        packed = [compression.compress(_tensor(t)) for t in tensors]
        outs = _reducescatter_op([w for w, _ in packed], op, float(prescale), float(postscale), name,
                                 process_set, ignore_name_scope)
        return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]


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
