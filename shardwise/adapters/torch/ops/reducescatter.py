"""reducescatter for torch: plain and grouped, blocking (differentiable) or async.

Part of :mod:`shardwise.adapters.torch.ops` (import from there).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from shardwise.core.comm import Communicator, ReduceOp
from shardwise.core.negotiation import Response

from ...horovod.coordinator import Future
from ...horovod.ops import Adasum, Average, OpLike, Sum
from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set
from ..compiling import not_traced
from ..compression import Compression, Compressor
from .allgather import _allgather_submit
from .handles import AsyncHandle
from .requests import _compressed, _scale, _spec, _submit

__all__ = ["reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async"]


# -- reducescatter ------------------------------------------------------------------------------------
def _reducescatter_submit(tensors: Sequence[torch.Tensor], op: Union[ReduceOp, str], prescale: float,
                          postscale: float, name: Optional[str], process_set: ProcessSet) -> Future:
    tensors = [t.detach().contiguous() for t in tensors]
    if op == Adasum:
        raise RuntimeError("reducescatter does not support op=Adasum")
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("reducescatter needs tensors of at least one dimension, got a scalar")
    wire, post = op, postscale
    if op is Average:
        wire, post = Sum, postscale / coordinator_of(process_set).comm.size

    def execute(comm: Communicator, response: Response) -> list[torch.Tensor]:
        return [_scale(comm.reduce_scatter(_scale(t, prescale).clone(), wire), post) for t in tensors]

    return _submit("reducescatter", name, tensors, process_set, execute, op=wire.value,
                   prescale=float(prescale), postscale=float(postscale))


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: tuple, *tensors: torch.Tensor) -> tuple:
        op, prescale, postscale, name, process_set = spec
        ctx.spec = spec
        return tuple(_reducescatter_submit(tensors, op, prescale, postscale, name, process_set).wait())

    @staticmethod
    @not_traced
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, prescale, postscale, _, process_set = ctx.spec
        full = _allgather_submit([g.contiguous() for g in grads], None, process_set).wait()
        # Horovod's gradient: the gathered gradient, times the set size for Sum (as allreduce's is).
        scale = prescale * postscale * (coordinator_of(process_set).comm.size if op is Sum else 1)
        return (None, *[_scale(f, scale) for f in full])


@not_traced
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: type[Compressor] = Compression.none, op: Optional[OpLike] = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks (default Average), keep this rank's rows of dim 0 (lowest ranks get extras)."""
    spec = _spec(op, None, prescale_factor, postscale_factor, name, process_set)
    return _compressed(_GroupedReducescatterFn, spec, [tensor], compression)[0]


@not_traced
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Optional[OpLike] = None,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> AsyncHandle:
    """Start a reducescatter; :func:`synchronize` returns this rank's rows."""
    spec = _spec(op, None, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_reducescatter_submit([tensor], *spec), lambda r: r[0])


@not_traced
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: type[Compressor] = Compression.none, op: Optional[OpLike] = None,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each of ``tensors``, as one request."""
    spec = _spec(op, None, prescale_factor, postscale_factor, name, process_set)
    return _compressed(_GroupedReducescatterFn, spec, tensors, compression)


@not_traced
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Optional[OpLike] = None, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> AsyncHandle:
    """Start a grouped reducescatter; :func:`synchronize` returns the list of results."""
    spec = _spec(op, None, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_reducescatter_submit(list(tensors), *spec))
