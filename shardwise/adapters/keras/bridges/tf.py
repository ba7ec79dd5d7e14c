"""The TensorFlow bridge: each collective is one ``tf.numpy_function`` op, eager or in a ``tf.function``.

XLA cannot compile a Python call, so a collective under ``jit_compile=True`` is
refused with a clear message (see :data:`XLA_MESSAGE`).
"""

from __future__ import annotations

from typing import Any, ContextManager, Optional, Sequence

import numpy as np
import tensorflow as tf

from ....core.errors import ConfigError
from .base import Bridge, CommFn

__all__ = ["TensorFlowBridge", "XLA_MESSAGE", "in_xla_context", "check_not_xla"]

XLA_MESSAGE = ("{what} cannot run inside an XLA-compiled function (jit_compile=True): shardwise "
               "collectives are Python calls (tf.numpy_function), which XLA cannot compile. Compile "
               "the model with model.compile(..., jit_compile=False); fit() and train_on_batch() turn "
               "XLA off by themselves, so this is a tf.function(jit_compile=True) of your own.")


def in_xla_context() -> bool:
    """True while tracing a function that XLA will compile (``jit_compile=True``)."""
    if tf.executing_eagerly():
        return False
    from tensorflow.python.ops import control_flow_util  # no public equivalent

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def check_not_xla(what: str) -> None:
    """Raise :class:`ConfigError` when called while tracing an XLA-compiled function."""
    if in_xla_context():
        raise ConfigError(XLA_MESSAGE.format(what=what))


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
