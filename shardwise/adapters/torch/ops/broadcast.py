"""broadcast for torch: out of place (differentiable) and in place, blocking or async.

Part of :mod:`shardwise.adapters.torch.ops` (import from there).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from shardwise.core.comm import Communicator
from shardwise.core.negotiation import Response

from ...horovod.coordinator import Future
from ...horovod.ops import Average
from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set
from ..compiling import not_traced
from .allreduce import _allreduce_submit
from .handles import AsyncHandle
from .requests import _set_relative_root, _submit

__all__ = ["broadcast", "broadcast_", "broadcast_async", "broadcast_async_"]


# -- broadcast -------------------------------------------------------------------------------------
def _broadcast_submit(tensor: torch.Tensor, root_rank: int, name: Optional[str], process_set: ProcessSet,
                      inplace: bool) -> Future:
    t = tensor.detach()
    root = _set_relative_root(root_rank, process_set)

    def execute(comm: Communicator, response: Response) -> torch.Tensor:
        if inplace and t.is_contiguous():
            return comm.broadcast(t, root, inplace=True)
        out = comm.broadcast(t.contiguous(), root)
        if inplace:
            t.copy_(out)
            return tensor
        return out

    return _submit("broadcast", name, [t], process_set, execute, root=root)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.process_set = root_rank, process_set
        return _broadcast_submit(tensor, root_rank, name, process_set, False).wait()

    @staticmethod
    @not_traced
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = _allreduce_submit([grad.contiguous()], Average, 1.0, 1.0, None, ctx.process_set).wait()[0]
        if coordinator_of(ctx.process_set).comm.rank != _set_relative_root(ctx.root, ctx.process_set):
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


@not_traced
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor``."""
    return _BroadcastFn.apply(tensor, int(root_rank), name, process_set)


@not_traced
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an out-of-place broadcast."""
    return AsyncHandle(_broadcast_submit(tensor, int(root_rank), name, process_set, False))


@not_traced
def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


@not_traced
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an in-place broadcast; :func:`synchronize` returns ``tensor``."""
    return AsyncHandle(_broadcast_submit(tensor, int(root_rank), name, process_set, True), lambda _: tensor)
