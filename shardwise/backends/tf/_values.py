"""What the ``tf`` backend accepts and returns: numpy arrays, TF tensors and ``tf.Variable``."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["is_numpy", "to_numpy", "finish"]


def is_numpy(tensor: Any, inplace: bool = False) -> bool:
    """True for numpy input, False for TF input; raises ``TypeError`` for anything unusable."""
    if isinstance(tensor, np.ndarray) or (np.isscalar(tensor) and not inplace):
        return True
    if isinstance(tensor, tf.Variable):
        return False
    if tf.is_tensor(tensor):
        if tf.is_symbolic_tensor(tensor):
            raise TypeError("the tf backend needs concrete values; inside tf.function use the "
                            "shardwise.keras / shardwise.tensorflow ops, which call it eagerly")
        if inplace:
            raise TypeError("TensorFlow tensors are immutable: inplace=True and recv need a tf.Variable "
                            "or a numpy array (or use the returned tensor)")
        return False
    raise TypeError(f"unsupported tensor type {type(tensor).__name__}; pass a numpy array, a TF tensor "
                    "or a tf.Variable")


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy view (numpy input) or copy (TF input) of ``tensor``."""
    if isinstance(tensor, tf.Variable) or tf.is_tensor(tensor):
        return np.asarray(tensor.numpy())
    return np.asarray(tensor)


def finish(original: Any, was_numpy: bool, result: Any, inplace: bool) -> Any:
    """``result`` as the caller's kind of object; written into ``original`` when ``inplace``."""
    if was_numpy:
        res = result.numpy() if tf.is_tensor(result) else np.asarray(result)
        if inplace:
            np.copyto(original, res.reshape(np.shape(original)))
            return original
        if isinstance(original, np.ndarray) and np.shares_memory(res, original):
            res = res.copy()
        return res
    res = result if tf.is_tensor(result) else tf.convert_to_tensor(result)
    if inplace:
        original.assign(res)
        return original
    return res
