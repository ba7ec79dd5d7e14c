"""Horovod-style data parallelism for Keras 3 (TensorFlow backend): ``import shardwise.keras as hvd``.

Typical use, under ``mpirun -np N python train.py``::

    import shardwise.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())), loss=...)
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()],
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()],
              verbose=2 if hvd.rank() == 0 else 0)
"""

from ..adapters.keras import (Compression, DistributedOptimizer, ZeroOptimizer, allgather, allreduce,
                              broadcast, broadcast_variables, disable_xla, init, local_rank, local_size,
                              rank, shutdown, size)
from . import callbacks

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "DistributedOptimizer",
           "ZeroOptimizer", "Compression", "allreduce", "allgather", "broadcast", "broadcast_variables",
           "callbacks", "disable_xla"]
