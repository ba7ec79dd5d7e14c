"""Gradient compression (Horovod's ``Compression.none`` / ``Compression.fp16``) for any tensor type.

One set of classes serves Keras 3 on every backend and the TensorFlow API: a
TensorFlow tensor is cast with ``tf.cast``, anything else with ``keras.ops.cast``.
"""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "dtype_name"]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def dtype_name(tensor: Any) -> str:
    """Keras's standard name of ``tensor``'s dtype (``float32``, ``int64``, ...)."""
    return keras.backend.standardize_dtype(tensor.dtype)


def _cast(tensor: Any, dtype: str) -> Any:
    if type(tensor).__module__.startswith("tensorflow"):
        import tensorflow as tf

        return tf.cast(tensor, dtype)
    return keras.ops.cast(tensor, dtype)


class Compressor:
    """Casts tensors before a collective and back after it (identity by default)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return the tensor to send and what :meth:`decompress` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Undo :meth:`compress`."""
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16; restore their dtype afterwards."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = dtype_name(tensor)
        if dtype in _FLOATS and dtype != "float16":
            return _cast(tensor, "float16"), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else _cast(tensor, ctx)


class Compression:
    """Gradient compression choices (Horovod's names): ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
