"""Turn what a user hands to ``parallelize`` (a layout, a config, a JSON file, ``"auto"``) into a layout."""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from ....core.config import TrainingConfig
from ....core.errors import ConfigError
from ....core.hardware import Hardware
from ....core.layout import ParallelLayout, read_json
from ....core.model_spec import ModelSpec
from ....core.planner import plan
from .stages import model_family

__all__ = ["LayoutSpec", "resolve_layout", "auto_layout"]

LayoutSpec = Union[ParallelLayout, TrainingConfig, Mapping[str, Any], str, "os.PathLike[str]"]

_DEEPSPEED_KEYS = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "pipeline",
                   "gradient_accumulation_steps", "fp16", "bf16", "bfloat16", "gradient_clipping", "optimizer",
                   "scheduler", "tensor_parallel", "expert_parallel"}


def _host_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * 2 ** 30


def _matmul_rate() -> float:
    """FLOP/s of this process on a 256 x 256 fp32 matmul (a few milliseconds to measure)."""
    a = torch.randn(256, 256)
    torch.mm(a, a)
    start = time.perf_counter()
    for _ in range(8):
        torch.mm(a, a)
    return 8 * 2 * 256 ** 3 / max(time.perf_counter() - start, 1e-9)


def local_hardware(model: nn.Module, world_size: int, local_size: int,
                   memory_per_rank: Optional[int] = None) -> Hardware:
    """The planner's view of the job's hardware: GPUs with the planner's defaults, or this host's CPUs.

    Ranks on one node share its memory (CPU) or have a GPU each. CPU ranks share the
    node's cores, are as fast as a measured matmul, and talk over shared memory.
    """
    node = max(1, min(local_size, world_size))
    on_gpu = any(p.is_cuda for p in model.parameters())
    if on_gpu:
        memory = memory_per_rank or torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return Hardware(num_devices=world_size, memory_per_device=int(memory), devices_per_node=node)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Hardware(num_devices=world_size, memory_per_device=int(memory_per_rank or _host_memory() // node),
                    devices_per_node=node, intra_node_bandwidth=2e9, intra_node_latency=30e-6,
                    inter_node_bandwidth=1e9, inter_node_latency=50e-6, peak_flops=_matmul_rate(),
                    efficiency=0.3, compute_units_per_node=cores if cores < node else None)


def auto_layout(model: nn.Module, world_size: int, *, seq_len: int, global_batch: int,
                memory_per_rank: Optional[int] = None, hardware: Optional[Hardware] = None,
                local_size: Optional[int] = None) -> ParallelLayout:
    """The planner's fastest fitting layout for ``model`` on ``world_size`` ranks that the runtime can run.

    Without ``hardware``, :func:`local_hardware` describes the job's nodes (this
    process's node, ``local_size`` ranks each).
    """
    # a Hugging Face model: the shape (experts included) from its config, the count from its tensors
    spec = ModelSpec.from_torch_module(model, seq_len=seq_len)
    if hardware is None:
        hardware = local_hardware(model, world_size, local_size or world_size, memory_per_rank)
    try:
        has_rules = model_family(model) is not None
    except ConfigError:
        has_rules = False
    result = plan(spec, hardware, global_batch=global_batch, optimizer="adam", precision="fp32",
                  sequence_and_vocab_parallel=has_rules)
    for cand in result.fitting:
        if cand.tp > 1 and not has_rules:
            continue  # tensor parallelism needs the family's split rules
        try:
            return ParallelLayout.from_plan(cand, precision="fp32")
        except ConfigError:
            continue  # a candidate the planner scores but the layout refuses
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
                   global_batch: Optional[int] = None, local_size: Optional[int] = None) -> ParallelLayout:
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
        layout = auto_layout(model, world_size, seq_len=seq_len, global_batch=global_batch,
                             local_size=local_size)
    elif isinstance(spec, Mapping):
        layout = _from_mapping(spec, world_size, tp, pp)
    elif isinstance(spec, (str, os.PathLike)):
        layout = _from_mapping(read_json(spec, "layout file"), world_size, tp, pp)
    else:
        raise ConfigError(f"a layout is a ParallelLayout, a TrainingConfig, a dict, a JSON path or 'auto'; "
                          f"got {type(spec).__name__}")
    layout.check_world(world_size)
    return layout
