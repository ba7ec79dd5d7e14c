"""Horovod's ``horovod.tensorflow.util`` helpers that scripts and tests reach for."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly() -> bool:
    """True when TensorFlow executes eagerly here (False while tracing a ``tf.function`` or building a graph)."""
    return tf.executing_eagerly()
