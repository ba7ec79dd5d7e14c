"""Horovod-compatible PyTorch API: ``import shardwise.torch as hvd`` in place of ``import horovod.torch as hvd``.

Runs on any shardwise backend (``mpi``, ``torch``, ``local``). Beyond Horovod:
:class:`DistributedDataParallel` (a DDP-style module wrapper with ``no_sync()``),
:class:`DistributedSampler`/:func:`shard_indices` and :func:`scale_lr`; :func:`parallelize` (a model,
an optimizer class and a :class:`ParallelLayout`, DeepSpeed config or plan -> a :class:`ParallelModel`
with ``train_step``); :class:`ZeroOptimizer`;
pipeline (:class:`PipelineExecutor`, :func:`split_sequential`, :func:`pipeline_from_sequential`)
and tensor parallelism (:class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
:class:`VocabParallelEmbedding`, :func:`vocab_parallel_cross_entropy`) on the mesh groups of
:func:`build_groups`; checkpoints (:func:`save_training`/:func:`restore_training`,
:func:`save_zero_checkpoint`/:func:`load_zero_checkpoint`); embedding tables sharded over the ranks
for recommendation models (:class:`ShardedEmbeddingBagCollection`, :class:`SparseOptimizer`,
:func:`save_embedding_checkpoint`/:func:`load_embedding_checkpoint`).

The same names by topic, in submodules: :mod:`shardwise.torch.parallel` (``parallelize``, layouts,
ZeRO, pipeline and tensor parallelism), :mod:`shardwise.torch.embedding` (sharded tables) and
:mod:`shardwise.torch.checkpoint`. The flat names stay.
"""

from shardwise.adapters.torch.basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                                             gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                                             local_rank, local_size, mpi_built, mpi_enabled,
                                             mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from shardwise.adapters.horovod.coordinator import CoordinatorShutdownError, DuplicateNameError
from shardwise.core.errors import CollectiveMismatchError as HorovodInternalError
from shardwise.adapters.torch.compression import Compression, Compressor
from shardwise.adapters.torch.data import DistributedSampler, scale_lr, shard_indices
from shardwise.adapters.torch.ddp import DistributedDataParallel
from shardwise.adapters.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                                broadcast_parameters)
from shardwise.adapters.torch.grad_sync import GradientSynchronizer, ModelMismatchError
from shardwise.adapters.torch.monitor import format_summary as format_monitor_summary
from shardwise.adapters.torch.monitor import monitor_optimizer
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.adapters.torch.ops import (Adasum, AsyncHandle, Average, Max, Min, Product, Sum, allgather,
                                          allgather_async, allreduce, allreduce_, allreduce_async,
                                          allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                                          broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                                          grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                                          grouped_allreduce_async, grouped_allreduce_async_,
                                          grouped_reducescatter, grouped_reducescatter_async, join, poll,
                                          reducescatter, reducescatter_async, sparse_allreduce_async,
                                          synchronize)
from shardwise.adapters.torch.optimizer import DistributedOptimizer
from shardwise.adapters.horovod.process_sets import (ProcessSet, add_process_set, global_process_set,
                                                     remove_process_set, start_timeline, stop_timeline)
from shardwise.adapters.torch.sync_batchnorm import SyncBatchNorm
from shardwise.adapters.torch.parallel import (ColumnParallelLinear, ParallelGroups, PipelineExecutor,
                                               RowParallelLinear, VocabParallelEmbedding, build_groups,
                                               pipeline_from_sequential, split_sequential,
                                               vocab_parallel_cross_entropy)
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.core.layout import ParallelLayout
from shardwise.adapters.torch.checkpoint.training import restore_training, save_training
from shardwise.adapters.torch.embedding import (CombinedOptimizer, KeyedJaggedTensor, ShardedEmbeddingBagCollection,
                                                ShardedEmbeddingCollection, SparseOptimizer, TableConfig, full_table,
                                                plan_tables)
from shardwise.adapters.torch.checkpoint.zero import (consolidate_zero_checkpoint, load_zero_checkpoint,
                                                      save_zero_checkpoint)
from shardwise.adapters.torch.checkpoint.embedding import load_embedding_checkpoint, save_embedding_checkpoint
from shardwise.core.pipeline import build_schedule

__all__ = [
    # process
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
    "rocm_built", "mpi_threads_supported", "ccl_built", "ddl_built", "is_homogeneous",
    # errors
    "HorovodInternalError", "DuplicateNameError", "CoordinatorShutdownError",
    # reduction ops
    "Average", "Sum", "Min", "Max", "Product", "Adasum",
    # collectives
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather", "allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "synchronize", "poll", "barrier", "join", "AsyncHandle",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "sparse_allreduce_async", "start_timeline", "stop_timeline",
    # state helpers
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    # training
    "DistributedOptimizer", "DistributedDataParallel", "GradientSynchronizer", "ModelMismatchError",
    "Compression", "Compressor", "SyncBatchNorm", "DistributedSampler", "shard_indices", "scale_lr",
    "ZeroOptimizer", "monitor_optimizer", "format_monitor_summary",
    # process sets
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    # one call: layout -> parallel model and optimizer
    "parallelize", "ParallelModel", "ParallelLayout",
    # 3D parallelism: mesh groups, pipeline, tensor parallelism
    "build_groups", "ParallelGroups", "PipelineExecutor", "split_sequential", "pipeline_from_sequential",
    "build_schedule",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    # checkpoints
    "save_training", "restore_training", "save_zero_checkpoint", "load_zero_checkpoint",
    "consolidate_zero_checkpoint",
    # recommendation models: embedding tables sharded over the ranks
    "ShardedEmbeddingBagCollection", "ShardedEmbeddingCollection", "KeyedJaggedTensor", "SparseOptimizer",
    "CombinedOptimizer", "TableConfig", "plan_tables", "full_table", "save_embedding_checkpoint",
    "load_embedding_checkpoint",
]

from shardwise.core.errors import HostsUpdatedInterrupt, WorkerLostError  # noqa: E402
from shardwise.torch import elastic  # noqa: E402  (hvd.elastic)

from shardwise.torch import checkpoint, embedding, parallel  # noqa: E402  (hvd.parallel.parallelize, ...)

__all__ += ["elastic", "HostsUpdatedInterrupt", "WorkerLostError"]
