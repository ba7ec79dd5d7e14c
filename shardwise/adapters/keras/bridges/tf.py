"""The TensorFlow bridge: each collective is one ``tf.numpy_function`` op, eager or in a ``tf.function``.

XLA cannot compile a Python call, so a collective under ``jit_compile=True`` is
refused with a clear message (see :mod:`shardwise.adapters.tensorflow.xla`).
"""

from __future__ import annotations

from typing import Any, ContextManager, Optional, Sequence

import numpy as np
import tensorflow as tf

from ...tensorflow.xla import check_not_xla
from .base import Bridge, CommFn

__all__ = ["TensorFlowBridge"]


class TensorFlowBridge(Bridge):
    """Collectives as ``tf.numpy_function`` ops chained by control dependencies."""

    name = "tensorflow"
    compiles = False

    def run(self, fn: CommFn, tensor: Any, shape: Optional[Sequence[int]] = None, after: Any = None) -> Any:
        tensor = tf.convert_to_tensor(tensor)
        with tf.control_dependencies([after] if after is not None else []):
            out = tf.numpy_function(lambda a: np.asarray(fn(a)), [tensor], tensor.dtype, stateful=True)
        out.set_shape(tensor.shape if shape is None else tf.TensorShape(list(shape)))
        return out

    def check_compilable(self, what: str) -> None:
        check_not_xla(what)

    def init_scope(self) -> ContextManager[Any]:
        return tf.init_scope()

    def in_trace(self) -> bool:
        return not tf.executing_eagerly()
