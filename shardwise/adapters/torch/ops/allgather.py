"""allgather for torch (plain, grouped, async, differentiable) and the allgather-based sparse allreduce.

Part of :mod:`shardwise.adapters.torch.ops` (import from there).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from shardwise.core.comm import Communicator
from shardwise.core.negotiation import Response

from ...horovod.coordinator import Future
from ...horovod.ops import Average, OpLike, resolve_op
from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set
from ..compiling import not_traced
from .allreduce import _allreduce_submit
from .handles import AsyncHandle
from .requests import _submit

__all__ = ["allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
           "sparse_allreduce_async"]



# -- allgather -------------------------------------------------------------------------------------
def _allgather_submit(tensors: Sequence[torch.Tensor], name: Optional[str], process_set: ProcessSet) -> Future:
    tensors = [t.detach().contiguous() for t in tensors]
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("allgather needs tensors of at least one dimension, got a scalar")

    def execute(comm: Communicator, response: Response) -> list[torch.Tensor]:
        return [comm.allgather(t) for t in tensors]

    return _submit("allgather", name, tensors, process_set, execute)


def _rows_of(response: Response, index: int) -> list[int]:
    return [m.shapes[index][0] for m in response.metas]


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: tuple, *tensors: torch.Tensor) -> tuple:
        name, process_set = spec
        ctx.process_set, ctx.dims = process_set, [t.shape[0] for t in tensors]
        return tuple(_allgather_submit(tensors, name, process_set).wait())

    @staticmethod
    @not_traced
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ps = ctx.process_set
        reduced = _allreduce_submit([g.contiguous() for g in grads], Average, 1.0, 1.0, None, ps).wait()
        dims = _allgather_submit([torch.tensor(ctx.dims, dtype=torch.int64)], None, ps).wait()[0]
        dims = dims.view(-1, len(ctx.dims))
        me = coordinator_of(ps).comm.rank
        offsets = dims[:me].sum(dim=0) if me else torch.zeros(len(ctx.dims), dtype=torch.int64)
        return (None, *[r.narrow(0, int(o), d) for r, o, d in zip(reduced, offsets, ctx.dims)])


@not_traced
def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 (first dimensions may differ)."""
    return _GroupedAllgatherFn.apply((name, process_set), tensor)[0]


@not_traced
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an allgather; :func:`synchronize` returns the concatenation."""
    return AsyncHandle(_allgather_submit([tensor], name, process_set), lambda r: r[0])


@not_traced
def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each of ``tensors``, as one request."""
    return list(_GroupedAllgatherFn.apply((name, process_set), *tensors))


@not_traced
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start a grouped allgather; :func:`synchronize` returns the list of results."""
    return AsyncHandle(_allgather_submit(list(tensors), name, process_set))


# -- sparse allreduce ----------------------------------------------------------------------------
@not_traced
def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: OpLike,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor by allgathering its indices and values; returns a closure to call.

    Duplicate indices are left uncoalesced, as in Horovod (they add up when densified).
    """
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(t.indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t.values(), name=f"{name}.values", process_set=process_set)
    average = resolve_op(op) is Average
    size = coordinator_of(process_set).comm.size

    def finish() -> torch.Tensor:
        v, i = values.wait(), indices.wait()
        v = v / size if average else v
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, t.size())

    return finish
