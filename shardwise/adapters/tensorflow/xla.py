"""XLA cannot compile shardwise's collectives: the check that refuses them with a clear message.

The TensorFlow ops (:mod:`.runtime`) and the Keras TensorFlow bridge
(:mod:`shardwise.adapters.keras.bridges.tf`) both run it before a collective.
"""

from __future__ import annotations

import tensorflow as tf

from ...core.errors import ConfigError

__all__ = ["XLA_MESSAGE", "in_xla_context", "check_not_xla"]

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
