"""ZeRO for Keras 3: ``from shardwise.keras.zero import ZeroOptimizer``.

Stages 1 and 2 shard the optimizer state (and the reduced gradients) on every
Keras backend; stage 3 also shards the model's variables, on torch and JAX::

    keras.utils.set_random_seed(0)
    with sharded_build():              # variables never whole on any rank
        model = make_model()
    model.compile(optimizer=ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=3), loss=...)
    model.fit(...)
    with full_weights(model):          # gathered whole on every rank, for export
        if shardwise.keras.rank() == 0:
            model.save_weights("model.weights.h5")

A sharded checkpoint holds each rank's shards and loads at any rank count and
stage: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`consolidate_checkpoint`.
The same names are in :mod:`shardwise.keras`.
"""

from ..adapters.keras.checkpoint import CheckpointInfo, consolidate_checkpoint, load_checkpoint, save_checkpoint
from ..adapters.keras.zero import ZeroOptimizer, full_weights, sharded_build

__all__ = ["ZeroOptimizer", "sharded_build", "full_weights", "save_checkpoint", "load_checkpoint",
           "consolidate_checkpoint", "CheckpointInfo"]
