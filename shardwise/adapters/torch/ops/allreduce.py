"""allreduce for torch: out of place (differentiable) and in place, grouped, async, and Adasum.

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
from .handles import AsyncHandle
from .requests import _compressed, _scale, _spec, _submit

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_"]


# -- allreduce -----------------------------------------------------------------------------------
def _allreduce_submit(tensors: Sequence[torch.Tensor], op: Union[ReduceOp, str], prescale: float,
                      postscale: float, name: Optional[str], process_set: ProcessSet,
                      outputs: Optional[Sequence[torch.Tensor]] = None) -> Future:
    """One request reducing ``tensors``; results go to ``outputs`` (in place) or new tensors."""
    tensors = [t.detach() for t in tensors]
    if op == Adasum:
        if prescale != 1.0 or postscale != 1.0:
            raise ValueError("prescale_factor and postscale_factor are not supported with op=Adasum")
        return _submit("adasum", name, tensors, process_set, _adasum_executor(tensors, outputs), op="adasum")
    wire, post = op, postscale
    if op is Average:
        wire, post = Sum, postscale / coordinator_of(process_set).comm.size

    def execute(comm: Communicator, response: Response) -> list[torch.Tensor]:
        results: list[Optional[torch.Tensor]] = [None] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):  # one flat buffer per dtype, in order
            idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = torch.cat([_scale(tensors[i], prescale).reshape(-1) for i in idx]) if len(idx) > 1 else \
                _scale(tensors[idx[0]], prescale).reshape(-1).clone()
            comm.allreduce(flat, wire, inplace=True)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                results[i] = _scale(flat[offset:offset + n].view(tensors[i].shape), post)
                offset += n
        if outputs is None:
            return results  # type: ignore[return-value]
        for out, res in zip(outputs, results):
            out.detach().copy_(res)
        return list(outputs)

    return _submit("allreduce", name, tensors, process_set, execute, op=wire.value, prescale=float(prescale),
                   postscale=float(postscale))


def _adasum_executor(tensors: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]]):
    def execute(comm: Communicator, response: Response) -> list[torch.Tensor]:
        from shardwise.core.adasum import adasum_allreduce

        results = []
        for t in tensors:
            if not t.is_floating_point():
                raise RuntimeError(f"Adasum reduces floating-point tensors only, got {t.dtype}")
            work = t.to(torch.float64).cpu().numpy().reshape(-1)
            reduced = torch.from_numpy(adasum_allreduce(comm, work)).view(t.shape).to(t.dtype)
            results.append(reduced)
        if outputs is None:
            return results
        for out, res in zip(outputs, results):
            out.detach().copy_(res)
        return list(outputs)

    return execute


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: tuple, *tensors: torch.Tensor) -> tuple:
        op, prescale, postscale, name, process_set = spec
        ctx.spec = (op, prescale, postscale, None, process_set)
        return tuple(_allreduce_submit(tensors, op, prescale, postscale, name, process_set).wait())

    @staticmethod
    @not_traced
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, prescale, postscale, _, process_set = ctx.spec
        grads = [g.contiguous() for g in grads]
        return (None, *_allreduce_submit(grads, op, prescale, postscale, None, process_set).wait())


@not_traced
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Optional[OpLike] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over the process set (default op: Average)."""
    spec = _spec(op, average, prescale_factor, postscale_factor, name, process_set)
    return _compressed(_GroupedAllreduceFn, spec, [tensor], compression)[0]


@not_traced
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an out-of-place allreduce; :func:`synchronize` returns the reduced tensor."""
    spec = _spec(op, average, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_allreduce_submit([tensor], *spec), lambda r: r[0])


@not_traced
def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


@not_traced
def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an in-place allreduce; :func:`synchronize` returns ``tensor``."""
    spec = _spec(op, average, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_allreduce_submit([tensor], *spec, outputs=[tensor]), lambda r: r[0])


@not_traced
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: type[Compressor] = Compression.none,
                      op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """New tensors: each of ``tensors`` reduced, all in one fused request."""
    spec = _spec(op, average, prescale_factor, postscale_factor, name, process_set)
    return _compressed(_GroupedAllreduceFn, spec, tensors, compression)


@not_traced
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[OpLike] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, *,
                            outputs: Optional[Sequence[torch.Tensor]] = None) -> AsyncHandle:
    """Start a grouped allreduce; :func:`synchronize` returns the list of results: new tensors, or
    ``outputs`` (the in-place variant passes ``tensors``)."""
    spec = _spec(op, average, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_allreduce_submit(list(tensors), *spec, outputs=None if outputs is None else list(outputs)))


@not_traced
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[OpLike] = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce ``tensors`` in place, as one request, and return them."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()


@not_traced
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[OpLike] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start a grouped in-place allreduce; :func:`synchronize` returns ``tensors``."""
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                                   outputs=tensors)
