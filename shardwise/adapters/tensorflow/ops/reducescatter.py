"""reducescatter for TensorFlow: one tensor or a group, as one request (differentiable).

Part of :mod:`shardwise.adapters.tensorflow.ops` (import from there).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from shardwise.core.comm import split_sizes

from ...horovod.compression import Compression, Compressor
from ...horovod.ops import Adasum, Average, OpLike, Sum
from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set
from .. import requests, runtime
from .base import _allgather_op, _device, _tensor, _zeros_for_none, handle_average_backwards_compatibility
from ..runtime import no_autograph

__all__ = ["reducescatter", "grouped_reducescatter"]


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
