"""Plain model parallelism: cut an ``nn.Sequential`` into contiguous stages of balanced cost.

Stage boundaries come from :func:`shardwise.core.layer_partition.partition_layers`
(optimal bottleneck; default cost of a layer = its parameter count). The stage
modules share the layer objects of the original model (nothing is copied) and
keep the original layer indices as names, so ``stage.state_dict()`` keys match
the full model's.

The simplest use is one micro-batch GPipe: each rank runs its stage, sends the
activation on, and gradients flow back (:func:`pipeline_from_sequential`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Sequence

from torch import nn

from ....core.comm import Communicator
from ....core.errors import ConfigError
from ....core.layer_partition import partition_layers
from ....core.pipeline import build_schedule
from .pipeline import LossFn, PipelineExecutor

__all__ = ["layer_costs", "stage_ranges", "split_sequential", "split_sequential_chunks",
           "pipeline_from_sequential"]


def layer_costs(model: nn.Sequential) -> list[float]:
    """Parameter count of each layer (the default partition cost)."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in model]


def stage_ranges(model: nn.Sequential, num_stages: int,
                 costs: Optional[Sequence[float]] = None) -> list[range]:
    """Layer index ranges of the ``num_stages`` stages (balanced by ``costs``)."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"layer split needs an nn.Sequential, got {type(model).__name__}")
    costs = layer_costs(model) if costs is None else list(costs)
    if len(costs) != len(model):
        raise ConfigError(f"got {len(costs)} layer costs for a model of {len(model)} layers")
    return partition_layers(costs, num_stages)


def _stage_module(model: nn.Sequential, rng: range) -> nn.Sequential:
    return nn.Sequential(OrderedDict((str(i), model[i]) for i in rng))


def split_sequential(model: nn.Sequential, num_stages: int, stage: int,
                     costs: Optional[Sequence[float]] = None) -> nn.Sequential:
    """The layers of stage ``stage`` of ``num_stages``, as an ``nn.Sequential`` named by layer index."""
    if not 0 <= stage < num_stages:
        raise ConfigError(f"stage {stage} is out of range for num_stages={num_stages}")
    return _stage_module(model, stage_ranges(model, num_stages, costs)[stage])


def split_sequential_chunks(model: nn.Sequential, pp_size: int, pp_rank: int, virtual_stages: int = 1,
                            costs: Optional[Sequence[float]] = None) -> list[nn.Sequential]:
    """The ``virtual_stages`` chunks of pipeline rank ``pp_rank``: model stages ``c * pp_size + pp_rank``."""
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pp_rank {pp_rank} is out of range for pp_size={pp_size}")
    ranges = stage_ranges(model, pp_size * virtual_stages, costs)
    return [_stage_module(model, ranges[c * pp_size + pp_rank]) for c in range(virtual_stages)]


def pipeline_from_sequential(model: nn.Sequential, pp_comm: Communicator, loss_fn: Optional[LossFn], *,
                             schedule: str = "gpipe", num_microbatches: int = 1, virtual_stages: int = 1,
                             costs: Optional[Sequence[float]] = None, **executor_options: Any) -> PipelineExecutor:
    """Split ``model`` over ``pp_comm`` and return the executor of this rank's chunk(s).

    Defaults to the plain layer split: GPipe with one micro-batch.
    """
    sched = build_schedule(schedule, pp_comm.size, num_microbatches, virtual_stages)
    chunks = split_sequential_chunks(model, pp_comm.size, pp_comm.rank, virtual_stages, costs)
    return PipelineExecutor(chunks, sched, pp_comm, loss_fn, **executor_options)
