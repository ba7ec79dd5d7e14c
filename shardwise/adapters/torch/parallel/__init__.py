"""Pipeline, tensor and layer parallelism for PyTorch on a 3D (dp x pp x tp) mesh.

* :func:`build_groups` -> :class:`ParallelGroups`: the dp, pp and tp communicators of a mesh;
* :class:`PipelineExecutor`: runs a core pipeline schedule (GPipe, 1F1B, interleaved);
* :func:`split_sequential` / :func:`pipeline_from_sequential`: plain layer split;
* :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`VocabParallelEmbedding`,
  :func:`vocab_parallel_cross_entropy`: Megatron-style tensor parallelism;
* :func:`average_gradients`: data-parallel gradient averaging over the dp group.
"""

from .layer_split import (layer_costs, pipeline_from_sequential, split_sequential, split_sequential_chunks,
                          stage_ranges)
from ....core.mesh_groups import ParallelGroups, build_groups
from .grad_average import average_gradients
from .pipeline import PipelineExecutor
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
                              scatter_to_tp_region, vocab_parallel_cross_entropy)

__all__ = [
    "ParallelGroups", "build_groups", "average_gradients",
    "PipelineExecutor",
    "layer_costs", "stage_ranges", "split_sequential", "split_sequential_chunks", "pipeline_from_sequential",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "copy_to_tp_region", "reduce_from_tp_region", "gather_from_tp_region", "scatter_to_tp_region",
]
