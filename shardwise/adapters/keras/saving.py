"""Horovod's ``hvd.load_model``: restore a saved Keras model with its optimizer wrapped for data parallelism.

It opens a ``.keras`` file or a sharded checkpoint directory of :mod:`.checkpoint`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras

from .checkpoint import is_sharded_checkpoint, load_model_from_checkpoint
from .ops import Compression, Compressor
from .optimizer import DistributedOptimizer

__all__ = ["load_model"]


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[dict[str, Any]] = None,
               compression: type[Compressor] = Compression.none) -> keras.Model:
    """Load a model saved by ``model.save`` and wrap its optimizer in a :class:`DistributedOptimizer`.

    The optimizer's state (iterations, slots) comes back from the file as Keras
    restores it; a model saved with a ``DistributedOptimizer`` comes back with one.
    ``custom_optimizers`` are optimizer classes the file may name besides Keras's own.
    ``filepath`` may also be a sharded checkpoint (a ``ckpt-<step>`` directory, or a
    directory of them: the newest complete one), written at any rank count and on any
    backend; a ZeroOptimizer comes back with its stage, sharded over this job's ranks.
    Collective then (every rank calls it).
    """
    objects: dict[str, Any] = {"DistributedOptimizer": DistributedOptimizer}
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    objects.update(custom_objects or {})
    if is_sharded_checkpoint(filepath):
        return load_model_from_checkpoint(filepath, custom_objects=objects,
                                          compression=None if compression is Compression.none else compression)
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        # The train step is traced at the first fit(), so replacing the optimizer now is enough.
        model.optimizer = DistributedOptimizer(optimizer, compression=compression)
    return model
