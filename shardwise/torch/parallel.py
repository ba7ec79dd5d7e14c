"""Model parallelism for PyTorch, one public home: ``from shardwise.torch.parallel import parallelize``.

* :func:`parallelize` (a model, an optimizer class and a :class:`ParallelLayout`, a plan JSON, a
  DeepSpeed config or ``"auto"``) -> :class:`ParallelModel` with ``train_step``;
  :class:`TrainingConfig` reads DeepSpeed JSON (``TrainingConfig.from_deepspeed(path)``);
* :class:`ZeroOptimizer`: ZeRO stages 1-3 over the data-parallel ranks;
* :func:`build_groups` -> :class:`ParallelGroups`: the dp, pp and tp communicators of a mesh;
* pipelines: :class:`PipelineExecutor`, :func:`build_schedule` (GPipe, 1F1B, interleaved),
  :func:`split_sequential`, :func:`split_sequential_chunks`, :func:`pipeline_from_sequential`;
* Megatron-style tensor parallelism: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`, :func:`vocab_parallel_cross_entropy`, :func:`padded_vocab_size`
  and the region functions (``copy_to_tp_region``, ...).

A thin re-export: the code lives in ``shardwise.adapters.torch.parallel`` and ``shardwise.core``.
"""

from shardwise.adapters.torch.parallel import (ColumnParallelLinear, ParallelGroups, PipelineExecutor,
                                               RowParallelLinear, VocabParallelEmbedding, average_gradients,
                                               build_groups, copy_to_tp_region, gather_from_tp_region,
                                               layer_costs, pipeline_from_sequential, reduce_from_tp_region,
                                               scatter_to_tp_region, split_sequential, split_sequential_chunks,
                                               stage_ranges, vocab_parallel_cross_entropy)
from shardwise.adapters.torch.parallel.init_replay import UnreplayableInitError
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.core.config import ConfigWarning, TrainingConfig
from shardwise.core.layout import ParallelLayout
from shardwise.core.pipeline import build_schedule
from shardwise.core.tensor_parallel import padded_vocab_size

__all__ = [
    "parallelize", "ParallelModel", "ParallelLayout", "TrainingConfig", "ConfigWarning", "UnreplayableInitError",
    "ZeroOptimizer",
    "build_groups", "ParallelGroups", "average_gradients",
    "PipelineExecutor", "build_schedule", "split_sequential", "split_sequential_chunks",
    "pipeline_from_sequential", "layer_costs", "stage_ranges",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "padded_vocab_size", "copy_to_tp_region", "reduce_from_tp_region", "gather_from_tp_region",
    "scatter_to_tp_region",
]
