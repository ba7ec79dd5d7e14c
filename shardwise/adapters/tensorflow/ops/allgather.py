"""allgather for TensorFlow: one tensor or a group, as one request (differentiable).

Part of :mod:`shardwise.adapters.tensorflow.ops` (import from there).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from ...horovod.process_sets import ProcessSet, global_process_set
from .base import _allgather_op, _tensor
from ..runtime import no_autograph

__all__ = ["allgather", "grouped_allgather"]


# -- allgather ------------------------------------------------------------------------------------
@no_autograph
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 (first dimensions may differ)."""
    return _allgather_op([_tensor(tensor)], name, process_set, ignore_name_scope)[0]


@no_autograph
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather each of ``tensors``, as one request."""
    if not tensors:
        return list(tensors)
    return _allgather_op([_tensor(t) for t in tensors], name, process_set, ignore_name_scope)
