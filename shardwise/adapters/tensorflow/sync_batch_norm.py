"""Horovod's ``SyncBatchNormalization`` for Keras 3: batch statistics averaged over all ranks in training."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from ..horovod.process_sets import global_process_set
from .ops import Sum, allreduce
from .runtime import no_autograph

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="shardwise")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``BatchNormalization`` whose training-time mean and variance are those of the global batch.

    Each rank contributes its batch mean and mean of squares (equal per-rank batch
    sizes, as Horovod assumes); the variance is ``E[x^2] - E[x]^2`` of the averages.
    Horovod's ``fused`` argument is accepted for compatibility and must be False.
    """

    def __init__(self, fused: Any = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        kwargs.setdefault("name", "sync_batch_normalization")
        super().__init__(**kwargs)

    @no_autograph
    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        mean, variance = super()._moments(inputs, mask)
        size = global_process_set.size()
        if size == 1:
            return mean, variance
        stack = tf.stack([mean, variance + tf.math.square(mean)])
        group = allreduce(stack, op=Sum) / tf.cast(size, stack.dtype)
        group_mean, group_mean_of_square = tf.unstack(group)
        return group_mean, group_mean_of_square - tf.math.square(group_mean)
