"""alltoall for torch: even blocks or explicit splits, blocking (differentiable) or async.

Part of :mod:`shardwise.adapters.torch.ops` (import from there).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from shardwise.core.comm import Communicator
from shardwise.core.negotiation import Response

from ...horovod.coordinator import Future
from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set
from ..compiling import not_traced
from .handles import AsyncHandle
from .requests import _submit

__all__ = ["alltoall", "alltoall_async"]


# -- alltoall ----------------------------------------------------------------------------------------
def _check_splits(tensor: torch.Tensor, splits: Any, size: int) -> list[int]:
    if splits is None:
        rows = tensor.shape[0] if tensor.dim() else 0
        if tensor.dim() == 0 or rows % size:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by the process set "
                             f"size {size}, got shape {tuple(tensor.shape)}")
        return [rows // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.is_complex():
            raise ValueError(f"alltoall splits must be integers, got a {splits.dtype} tensor")
        values = [int(s) for s in splits.reshape(-1).tolist()]
    else:
        values = [int(s) for s in splits]
    if any(v < 0 for v in values):
        raise ValueError(f"alltoall splits must be non-negative, got {values}")
    if tensor.dim() == 0 or sum(values) != tensor.shape[0]:
        raise ValueError(f"alltoall splits {values} must sum to the first dimension of shape "
                         f"{tuple(tensor.shape)}")
    return values


def _alltoall_submit(tensor: torch.Tensor, splits: Any, name: Optional[str], process_set: ProcessSet) -> Future:
    t = tensor.detach().contiguous()
    size = coordinator_of(process_set).comm.size
    sent = _check_splits(t, splits, size)

    def execute(comm: Communicator, response: Response) -> tuple[torch.Tensor, torch.Tensor]:
        received = torch.tensor([m.splits[comm.rank] for m in response.metas], dtype=torch.int32)
        return comm.alltoall(t, sent), received

    return _submit("alltoall", name, [t], process_set, execute, splits=tuple(sent))


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str], process_set: ProcessSet) -> tuple:
        out, received = _alltoall_submit(tensor, splits, name, process_set).wait()
        ctx.process_set, ctx.received = process_set, received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    @not_traced
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple:
        out, _ = _alltoall_submit(grad.contiguous(), ctx.received, None, ctx.process_set).wait()
        return out, None, None, None


@not_traced
def alltoall(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send block ``i`` of dim 0 to rank ``i``; with ``splits``, return ``(output, received_splits)``."""
    out, received = _AlltoallFn.apply(tensor, splits, name, process_set)
    return (out, received) if splits is not None else out


@not_traced
def alltoall_async(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an alltoall; :func:`synchronize` returns the rows (and received splits, given ``splits``)."""
    return AsyncHandle(_alltoall_submit(tensor, splits, name, process_set),
                       (lambda r: r) if splits is not None else (lambda r: r[0]))
