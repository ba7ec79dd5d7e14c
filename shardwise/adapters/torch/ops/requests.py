"""Request plumbing shared by the torch collectives of :mod:`shardwise.adapters.torch.ops`.

Naming a request and submitting it to the process set's coordinator, Horovod's
pre/postscaling, roots relative to a process set, and the ``(op, prescale,
postscale, name, process_set)`` spec that the reducing collectives pass around.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from shardwise.core.comm import Communicator
from shardwise.core.negotiation import RequestMeta, Response

from ...horovod.coordinator import Coordinator, Future
from ...horovod.ops import resolve_op
from ...horovod.process_sets import ProcessSet, coordinator_of


# -- request plumbing ----------------------------------------------------------------------------
def _device(tensor: torch.Tensor) -> str:
    return "cpu" if tensor.device.type == "cpu" else "gpu"


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _submit(kind: str, name: Optional[str], tensors: Sequence[torch.Tensor], process_set: ProcessSet,
            execute: Callable[[Communicator, Response], Any], **meta: Any) -> Future:
    coordinator: Coordinator = coordinator_of(process_set)
    full = f"{kind}.{name}" if name else coordinator.auto_name(kind)
    request = RequestMeta(full, kind, tuple(_dtype(t) for t in tensors), tuple(tuple(t.shape) for t in tensors),
                          device=_device(tensors[0]) if tensors else "cpu", **meta)
    return coordinator.submit(request, execute)


def _scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` as Horovod scales on CPU: integers in float64, halves in float32, cast back."""
    if factor == 1.0:
        return tensor
    if not tensor.is_floating_point():
        return (tensor.to(torch.float64) * factor).to(tensor.dtype)
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return (tensor.float() * factor).to(tensor.dtype)
    return tensor * factor


def _set_relative_root(root_rank: int, process_set: ProcessSet) -> int:
    if process_set is None or process_set.is_global():
        return int(root_rank)
    ranks = process_set.ranks
    return ranks.index(int(root_rank)) if int(root_rank) in ranks else -1 - int(root_rank)


def _spec(op: Any, average: Optional[bool], prescale: float, postscale: float, name: Optional[str],
          process_set: ProcessSet) -> tuple:
    return (resolve_op(op, average), float(prescale), float(postscale), name, process_set)


def _compressed(function: Any, spec: tuple, tensors: Sequence[torch.Tensor], compression: Any) -> list[torch.Tensor]:
    """``function.apply(spec, *wires)`` (a grouped collective's autograd function) on the compressed
    ``tensors``, its results decompressed."""
    packed = [compression.compress(t) for t in tensors]
    outs = function.apply(spec, *[wire for wire, _ in packed])
    return [compression.decompress(out, ctx) for out, (_, ctx) in zip(outs, packed)]
