"""Horovod's ``horovod.tensorflow.DistributedOptimizer``: a legacy TensorFlow optimizer or a Keras one.

A legacy ``tf.compat.v1.train.Optimizer`` gets the TensorFlow adapter's
:class:`~shardwise.adapters.tensorflow.optimizer.LegacyDistributedOptimizer`; a Keras 3
optimizer gets this adapter's :class:`~.optimizer.DistributedOptimizer`. Choosing needs
both adapters, so the choice sits here, in the one that builds on the other.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from ..horovod.compression import Compression, Compressor
from ..horovod.process_sets import ProcessSet, global_process_set
from ..tensorflow.ops import Adasum, Average, OpLike
from ..tensorflow.optimizer import LegacyDistributedOptimizer, LegacyOptimizer
from ..tensorflow.tape import GradientReducer
from .optimizer import DistributedOptimizer as KerasDistributedOptimizer

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: OpLike = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap ``optimizer`` so that gradients are reduced over the process set before they are applied."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if groups is None and num_groups:
        groups = num_groups
    if isinstance(optimizer, LegacyOptimizer):
        if op == Adasum:
            raise NotImplementedError("op=Adasum is not supported by shardwise's TensorFlow DistributedOptimizer")
        reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                                  process_set, device_dense, device_sparse)
        return LegacyDistributedOptimizer(optimizer, reducer, name=name, use_locking=use_locking,
                                          backward_passes_per_step=backward_passes_per_step,
                                          average_aggregated_gradients=average_aggregated_gradients,
                                          scale_local_gradients=scale_local_gradients)
    if gradient_predivide_factor != 1.0 or groups is not None:
        warnings.warn("with a Keras optimizer, shardwise ignores gradient_predivide_factor and groups (its "
                      "fused buckets reduce dense gradients)")
    return KerasDistributedOptimizer(optimizer, compression=compression,
                                     backward_passes_per_step=backward_passes_per_step,
                                     average_aggregated_gradients=average_aggregated_gradients, name=name, op=op,
                                     process_set=process_set, scale_local_gradients=scale_local_gradients)
