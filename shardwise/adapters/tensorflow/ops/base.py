"""The building blocks of the TensorFlow collectives: argument helpers and the dense allreduce/allgather.

``_allreduce_op`` and ``_allgather_op`` are the differentiable dense allreduce and
allgather (one request each, with Horovod's gradients); the other collectives'
gradients are built from them. Part of :mod:`shardwise.adapters.tensorflow.ops`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import tensorflow as tf

from ...horovod.ops import Average, OpLike, resolve_op
from ...horovod.process_sets import ProcessSet, coordinator_of
from .. import requests, runtime

__all__ = ["handle_average_backwards_compatibility"]


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
