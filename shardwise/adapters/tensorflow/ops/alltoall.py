"""alltoall for TensorFlow: even blocks or explicit splits (differentiable: the reverse alltoall).

Part of :mod:`shardwise.adapters.tensorflow.ops` (import from there).
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set
from .. import requests, runtime
from .base import _tensor, _zeros_for_none
from ..runtime import no_autograph

__all__ = ["alltoall"]


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
