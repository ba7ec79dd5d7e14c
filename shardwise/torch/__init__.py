"""Horovod-compatible PyTorch API: ``import shardwise.torch as hvd`` in place of ``import horovod.torch as hvd``.

Runs on any shardwise backend (``mpi``, ``torch``, ``local``). Beyond Horovod:
:class:`DistributedDataParallel` (a DDP-style module wrapper with ``no_sync()``),
:class:`DistributedSampler`/:func:`shard_indices` and :func:`scale_lr`.
"""

from shardwise.adapters.torch.basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                                             gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                                             local_rank, local_size, mpi_built, mpi_enabled,
                                             mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from shardwise.adapters.coordinator import CoordinatorShutdownError, DuplicateNameError
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
from shardwise.adapters.process_sets import (ProcessSet, add_process_set, global_process_set,
                                             remove_process_set, start_timeline, stop_timeline)
from shardwise.adapters.torch.sync_batchnorm import SyncBatchNorm

__all__ = ["monitor_optimizer", "format_monitor_summary", "ZeroOptimizer", 
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
    # process sets
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
]

from shardwise.core.errors import HostsUpdatedInterrupt, WorkerLostError  # noqa: E402
from shardwise.torch import elastic  # noqa: E402  (hvd.elastic)

__all__ += ["elastic", "HostsUpdatedInterrupt", "WorkerLostError"]
