"""Horovod-style data parallelism for Keras 3 on TensorFlow, torch or JAX: ``import shardwise.keras as hvd``.

Typical use, under ``mpirun -np N python train.py``::

    import shardwise.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())), loss=...)
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()],
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()],
              verbose=2 if hvd.rank() == 0 else 0)

The names are Horovod's (``horovod.tensorflow.keras``). The backend is Keras's
(``KERAS_BACKEND``); on TensorFlow the collectives are those of
:mod:`shardwise.tensorflow`, negotiated by name across ranks; on torch and JAX they
run on the backend's own tensors and TensorFlow is never imported.
"""

from ..adapters.horovod.basics import (ccl_built, cross_rank, cross_size, ddl_built, gloo_built, gloo_enabled,
                                       is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                       mpi_threads_supported, rank, size)
from ..adapters.horovod.compression import Compression
from ..adapters.horovod.ops import Adasum, Average, Max, Min, Product, Sum
from ..adapters.horovod.process_sets import (ProcessSet, add_process_set, global_process_set, remove_process_set,
                                             start_timeline, stop_timeline)
from ..adapters.keras import broadcast_variables, disable_xla
from ..adapters.keras.bridges import backend_name
from ..adapters.keras.checkpoint import CheckpointInfo, consolidate_checkpoint, load_checkpoint, save_checkpoint
from ..adapters.keras.embedding import ShardedEmbeddingBag
from ..adapters.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from ..adapters.keras.pipeline import KerasPipeline
from ..adapters.keras.saving import load_model
from ..adapters.keras.zero import ZeroOptimizer, full_weights, sharded_build
from . import callbacks, elastic, zero

if backend_name() == "tensorflow":
    from ..adapters.keras.hvd_api import (allgather, allreduce, alltoall, broadcast, broadcast_global_variables,
                                          reducescatter)
    from ..adapters.tensorflow.basics import cuda_built, init, nccl_built, rocm_built, shutdown
    from ..adapters.tensorflow.functions import allgather_object, broadcast_object
    from ..adapters.tensorflow.ops import barrier, join
else:
    from ..adapters.keras.hvd_portable import (allgather, allgather_object, allreduce, alltoall, barrier, broadcast,
                                               broadcast_global_variables, broadcast_object, cuda_built, init, join,
                                               nccl_built, reducescatter, rocm_built, shutdown)

__all__ = [
    # process
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ccl_built", "ddl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    # collectives
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "allreduce", "allgather", "broadcast", "reducescatter",
    "alltoall", "barrier", "join", "broadcast_object", "allgather_object",
    # state
    "broadcast_variables", "broadcast_global_variables", "load_model",
    # sharded checkpoints (any rank count, ZeRO stage and backend)
    "save_checkpoint", "load_checkpoint", "consolidate_checkpoint", "CheckpointInfo",
    # training
    "DistributedOptimizer", "PartialDistributedOptimizer", "ZeroOptimizer", "Compression", "callbacks",
    "disable_xla", "elastic", "sharded_build", "full_weights", "zero",
    # pipeline parallelism: a Sequential's layers split over ranks (GPipe / 1F1B)
    "KerasPipeline",
    # sharded embedding tables (torch and jax backends)
    "ShardedEmbeddingBag",
    # process sets
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
]
