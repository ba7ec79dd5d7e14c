"""Turn what a user hands to ``parallelize`` (a layout, a config, a JSON file, ``"auto"``) into a layout."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

from torch import nn

from ....core.config import TrainingConfig
from ....core.errors import ConfigError
from ....core.hardware import Hardware
from ....core.layout import ParallelLayout, read_json
from ....core.model_spec import ModelSpec
from ....core.planner import plan

__all__ = ["LayoutSpec", "resolve_layout", "auto_layout"]

LayoutSpec = Union[ParallelLayout, TrainingConfig, Mapping[str, Any], str, "os.PathLike[str]"]

_DEEPSPEED_KEYS = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                   "gradient_accumulation_steps", "fp16", "bf16", "bfloat16", "gradient_clipping", "optimizer",
                   "scheduler"}


def _host_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * 2 ** 30


def auto_layout(model: nn.Module, world_size: int, *, seq_len: int, global_batch: int,
                memory_per_rank: Optional[int] = None, hardware: Optional[Hardware] = None) -> ParallelLayout:
    """The planner's fastest fitting layout for ``model`` on ``world_size`` ranks that the runtime can run.

    Without ``hardware`` the ranks are taken to share this host: each gets an equal
    part of its memory (or ``memory_per_rank`` bytes).
    """
    spec = ModelSpec.from_torch_module(model, seq_len=seq_len)
    if hardware is None:
        memory = memory_per_rank or _host_memory() // world_size
        hardware = Hardware(num_devices=world_size, memory_per_device=int(memory),
                            devices_per_node=world_size)
    result = plan(spec, hardware, global_batch=global_batch, optimizer="adam", precision="fp32")
    for cand in result.fitting:
        try:
            return ParallelLayout.from_plan(cand, precision="fp32")
        except ConfigError:
            continue  # e.g. ZeRO with a pipeline, which the planner scores but the runtime refuses
    raise ConfigError(f"the planner found no runnable layout for {world_size} ranks "
                      f"({len(result.fitting)} fit, none of them runnable)")


def _from_mapping(data: Mapping[str, Any], world_size: int, tp: int, pp: int) -> ParallelLayout:
    if "best" in data:
        return ParallelLayout.from_plan(data)
    if _DEEPSPEED_KEYS & set(data):
        return ParallelLayout.from_config(TrainingConfig.from_deepspeed(data), world_size, tp=tp, pp=pp)
    return ParallelLayout.from_dict(data)


def resolve_layout(spec: LayoutSpec, world_size: int, *, tp: int = 1, pp: int = 1,
                   model: Optional[nn.Module] = None, seq_len: Optional[int] = None,
                   global_batch: Optional[int] = None) -> ParallelLayout:
    """A checked layout for ``world_size`` ranks from any accepted form.

    ``spec`` is a :class:`ParallelLayout`; a :class:`TrainingConfig` (dp fills the
    ranks left by ``tp`` and ``pp``); a dict or JSON file holding a DeepSpeed config,
    a ``shardwise plan --json`` result or layout fields; or ``"auto"`` (needs
    ``model``, ``seq_len`` and ``global_batch``).
    """
    if isinstance(spec, ParallelLayout):
        layout = spec
    elif isinstance(spec, TrainingConfig):
        layout = ParallelLayout.from_config(spec, world_size, tp=tp, pp=pp)
    elif isinstance(spec, str) and spec == "auto":
        if model is None or seq_len is None or global_batch is None:
            raise ConfigError("layout='auto' needs the model, seq_len and global_batch")
        layout = auto_layout(model, world_size, seq_len=seq_len, global_batch=global_batch)
    elif isinstance(spec, Mapping):
        layout = _from_mapping(spec, world_size, tp, pp)
    elif isinstance(spec, (str, os.PathLike)):
        layout = _from_mapping(read_json(spec, "layout file"), world_size, tp, pp)
    else:
        raise ConfigError(f"a layout is a ParallelLayout, a TrainingConfig, a dict, a JSON path or 'auto'; "
                          f"got {type(spec).__name__}")
    layout.check_world(world_size)
    return layout
