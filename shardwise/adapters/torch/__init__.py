"""The PyTorch data-parallel adapter: gradient synchronisation, DDP wrapper, Horovod-style API.

The public, Horovod-compatible namespace is :mod:`shardwise.torch`
(``import shardwise.torch as hvd``); this package holds the implementation.
"""

from .compression import BF16Compressor, Compression, Compressor, FP16Compressor, NoneCompressor
from .data import DistributedSampler, scale_lr, shard_indices
from .ddp import DistributedDataParallel
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters,
                        broadcast_tensors)
from .grad_sync import GradientSynchronizer, ModelMismatchError, agree_parameters
from .optimizer import DistributedOptimizer
from ..horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batchnorm import SyncBatchNorm

__all__ = [
    "GradientSynchronizer", "ModelMismatchError", "agree_parameters", "DistributedDataParallel",
    "DistributedOptimizer", "Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor",
    "SyncBatchNorm", "DistributedSampler", "shard_indices", "scale_lr", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object", "broadcast_tensors",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
]
