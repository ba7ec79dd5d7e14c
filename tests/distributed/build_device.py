"""Scenario: a meta-built model lands, whole, on the device ``parallelize`` is given (and on the default)."""

from __future__ import annotations

from typing import Any

import torch

import shardwise
from hf_parallel import OPT_ARGS, OPTIMIZER, _batches, build
from sharded_build import _compare, _count, _meta, _whole
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.core.layout import ParallelLayout


def _placed(pm: ParallelModel, device: torch.device) -> int:
    """Raise unless every parameter, buffer, ZeRO shard, master and state of this rank is on ``device``."""
    tensors = [("parameter " + n, p) for n, p in pm.module.named_parameters()]
    tensors += [("buffer " + n, b) for n, b in pm.module.named_buffers()]
    if isinstance(pm.optimizer, ZeroOptimizer):
        for unit in pm.optimizer.units:
            tensors += [(f"unit {unit.index} shard", unit.shard), (f"unit {unit.index} master", unit.master)]
    for p, state in pm.optimizer.state.items():
        tensors += [(f"optimizer state {k}", v) for k, v in state.items() if torch.is_tensor(v) and v.dim()]
    wrong = [f"{what} on {t.device}" for what, t in tensors if t.device != device]
    if wrong or pm.device != device:
        raise AssertionError(f"not on {device} (ParallelModel.device {pm.device}): {wrong[:6]}")
    return len(tensors)


def on_device(backend: str, cases: list[list[Any]]) -> None:
    """``device="cpu"`` and the default (the CPU here) give the one-process initial weights, placed there."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    cpu = torch.device("cpu")
    batch = _batches()[0]
    for family, fields in cases:
        ref = build(family)
        for name, kwargs in (("device='cpu'", {"device": "cpu"}), ("default", {})):
            torch.manual_seed(0)
            pm = parallelize(_meta(family), OPTIMIZER, ParallelLayout(**fields), **kwargs, **OPT_ARGS)
            checked = _count(world, _compare(_whole(pm), ref, f"{name} initial weights", exact=True))
            if checked != len(dict(ref.named_parameters())):
                raise AssertionError(f"{checked} tensors checked, the model has {len(dict(ref.named_parameters()))}")
            pm.train_step(pm.shard_batch(batch))  # the optimizer state exists after a step
            count = _placed(pm, cpu)
            pm.groups.free()
            if world.rank == 0:
                print(f"OK device {family} {pm.layout.describe()} {name}: {count} tensors on cpu, "
                      f"{checked} equal to one process", flush=True)
