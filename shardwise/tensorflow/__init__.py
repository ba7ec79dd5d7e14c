"""Horovod-compatible TensorFlow API: ``import shardwise.tensorflow as hvd`` for ``import horovod.tensorflow as hvd``.

Typical use, under ``mpirun -np N python train.py``::

    import shardwise.tensorflow as hvd
    hvd.init()
    dataset = hvd.shard(dataset)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))

    hvd.broadcast_variables(model.variables, root_rank=0)

Collectives work eagerly, inside ``tf.function`` and in TF1 graphs, on any shardwise
backend; they are matched across ranks by name, and ranks that disagree (shapes,
dtypes, ops, roots) get ``tf.errors.FailedPreconditionError`` on every rank instead
of a hang. Beyond Horovod: :func:`shard` and the ``tf.distribute`` strategy choice
(:func:`strategy`).
"""

from shardwise.adapters.horovod.basics import (ccl_built, cross_rank, cross_size, ddl_built, gloo_built, gloo_enabled,
                                               is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                                               mpi_enabled, mpi_threads_supported, rank, size)
from shardwise.adapters.horovod.compression import Compression, Compressor
from shardwise.adapters.horovod.process_sets import (ProcessSet, add_process_set, global_process_set,
                                                     remove_process_set, start_timeline, stop_timeline)
from shardwise.adapters.tensorflow import elastic, shard, util
from shardwise.adapters.tensorflow import runtime as _tf_runtime
from shardwise.adapters.tensorflow.basics import (cuda_built, init, local_rank_op, local_size_op, nccl_built,
                                                  process_set_included_op, rank_op, rocm_built, shutdown, size_op)
from shardwise.adapters.tensorflow.functions import (allgather_object, broadcast_global_variables, broadcast_object,
                                                     broadcast_object_fn, broadcast_variables)
from shardwise.adapters.tensorflow.ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce,
                                               alltoall, barrier, broadcast, broadcast_, grouped_allgather,
                                               grouped_allreduce, grouped_reducescatter,
                                               handle_average_backwards_compatibility, join, reducescatter)
from shardwise.adapters.keras.tf_optimizer import DistributedOptimizer
from shardwise.adapters.tensorflow.strategy import (Detection, StrategyChoice, choose_strategy, detect, strategy,
                                                    tf_config)
from shardwise.adapters.tensorflow.sync_batch_norm import SyncBatchNormalization
from shardwise.adapters.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape
from shardwise.adapters.tensorflow.util import _executing_eagerly
from shardwise.backends.tf._runtime import start_if_requested as _start_tf_runtime

# TF1 sessions run each waiting collective on an inter-op thread: size the pool before TF starts
# (unless the user chose a size), so that a step with many collectives cannot starve itself.
_tf_runtime.reserve_inter_op_threads()
# With SHARDWISE_BACKEND=tf, start TensorFlow's collective runtime now: it can only be configured before
# the first TensorFlow op, and programs run ops (variables, device queries) before hvd.init().
_start_tf_runtime()

__all__ = [
    # process
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ccl_built",
    "ddl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    # reduction ops
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "handle_average_backwards_compatibility",
    # collectives
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "join", "barrier",
    # state helpers
    "broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "allgather_object", "elastic", "util",
    # training
    "DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape", "Compression",
    "Compressor", "SyncBatchNormalization", "shard",
    # process sets
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    # tf.distribute
    "strategy", "choose_strategy", "detect", "Detection", "StrategyChoice", "tf_config",
]
