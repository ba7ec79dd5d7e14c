"""Horovod's tensor collectives for torch (``hvd.allreduce`` and friends) on any shardwise backend.

Out-of-place calls are differentiable like Horovod's (the backward of an
allreduce is an allreduce of the gradient, and so on). ``*_async`` calls return
an :class:`AsyncHandle` for :func:`synchronize` and :func:`poll`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from shardwise.core.comm import Communicator, Handle, ReduceOp
from shardwise.core.errors import ConfigError

from .compression import Compression, Compressor
from .process_sets import ProcessSet, comm_of, global_process_set

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "AsyncHandle", "resolve_op",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather", "allgather_async",
           "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async",
           "reducescatter", "reducescatter_async", "synchronize", "poll", "barrier"]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
#: Horovod's Adasum reduction; accepted as a name but not implemented by shardwise.
Adasum = "adasum"

OpLike = Union[ReduceOp, str]


def resolve_op(op: Optional[OpLike], average: Optional[bool] = None, default: ReduceOp = Average) -> ReduceOp:
    """Horovod's ``op``/``average`` arguments as a :class:`ReduceOp` (Adasum is refused)."""
    if op is not None and average is not None:
        raise ConfigError("pass either op= or the deprecated average=, not both")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return default
    if isinstance(op, str) and op.strip().lower() == Adasum:
        raise NotImplementedError("op=Adasum is not supported by shardwise; use op=hvd.Average or hvd.Sum")
    return ReduceOp.parse(op)


class AsyncHandle:
    """A collective in flight; :func:`synchronize` returns its result, :func:`poll` says if it is done."""

    def __init__(self, handle: Handle, finish: Callable[[Any], Any] = lambda r: r) -> None:
        self._handle, self._finish = handle, finish
        self._done, self._result = False, None

    def wait(self) -> Any:
        """Complete the collective and return its result."""
        if not self._done:
            self._result, self._done = self._finish(self._handle.wait()), True
            self._handle = None
        return self._result

    def done(self) -> bool:
        """True when :meth:`wait` would not block."""
        return self._done or self._handle.done()


def synchronize(handle: AsyncHandle) -> Any:
    """Wait for an async collective and return its output."""
    if not isinstance(handle, AsyncHandle):
        raise ConfigError(f"synchronize() takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.wait()


def poll(handle: AsyncHandle) -> bool:
    """True when the async collective behind ``handle`` has completed."""
    if not isinstance(handle, AsyncHandle):
        raise ConfigError(f"poll() takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.done()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` reaches the barrier."""
    comm_of(process_set).barrier()


# -- allreduce ---------------------------------------------------------------------------------
def _allreduce_start(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                     compression: type[Compressor], comm: Communicator, inplace: bool,
                     name: Optional[str] = None) -> AsyncHandle:
    t = tensor.detach()
    src = t * prescale if prescale != 1.0 else t
    wire, ctx = compression.compress(src)
    fresh = wire is not t  # a tensor we made may be reduced in place
    handle = comm.allreduce_async(wire, op, inplace=inplace or fresh, name=name)

    def finish(result: torch.Tensor) -> torch.Tensor:
        out = compression.decompress(result, ctx)
        if postscale != 1.0:
            out = out.mul_(postscale)  # ``out`` is never the caller's tensor unless in place
        if inplace:
            if out is not t:
                t.copy_(out)
            return tensor
        return out

    return AsyncHandle(handle, finish)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                compression: type[Compressor], comm: Communicator, name: Optional[str]) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, comm)
        return _allreduce_start(tensor, op, prescale, postscale, compression, comm, False, name).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, prescale, postscale, comm = ctx.args
        out = _allreduce_start(grad.contiguous(), op, prescale, postscale, Compression.none, comm, False).wait()
        return out, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Optional[OpLike] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over the process set (default op: Average)."""
    return _AllreduceFn.apply(tensor, resolve_op(op, average), float(prescale_factor),
                              float(postscale_factor), compression, comm_of(process_set), name)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an out-of-place allreduce; :func:`synchronize` returns the reduced tensor."""
    return _allreduce_start(tensor, resolve_op(op, average), float(prescale_factor), float(postscale_factor),
                            Compression.none, comm_of(process_set), False, name)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an in-place allreduce; :func:`synchronize` returns ``tensor``."""
    return _allreduce_start(tensor, resolve_op(op, average), float(prescale_factor), float(postscale_factor),
                            Compression.none, comm_of(process_set), True, name)


# -- allgather -----------------------------------------------------------------------------------
def _rows(comm: Communicator, n: int) -> list[int]:
    return [int(r) for r in comm.allgather(torch.tensor([n], dtype=torch.int64))]


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        ctx.rows = _rows(comm, tensor.shape[0] if tensor.dim() else 1) if ctx.needs_input_grad[0] else None
        ctx.shape = tensor.shape
        return comm.allgather(tensor.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = ctx.comm.allreduce(grad.contiguous(), Average)
        start = sum(ctx.rows[: ctx.comm.rank])
        return reduced[start: start + ctx.rows[ctx.comm.rank]].reshape(ctx.shape), None


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 (first dimensions may differ)."""
    return _AllgatherFn.apply(tensor, comm_of(process_set))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an allgather; :func:`synchronize` returns the concatenation."""
    return AsyncHandle(comm_of(process_set).allgather_async(tensor.detach()))


# -- broadcast -----------------------------------------------------------------------------------
class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, comm: Communicator) -> torch.Tensor:
        ctx.root, ctx.comm = root, comm
        return comm.broadcast(tensor.detach(), root)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = ctx.comm.allreduce(grad.contiguous(), Average)
        if ctx.comm.rank != ctx.root:
            reduced.zero_()
        return reduced, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor``."""
    return _BroadcastFn.apply(tensor, int(root_rank), comm_of(process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an out-of-place broadcast."""
    return AsyncHandle(comm_of(process_set).broadcast_async(tensor.detach(), int(root_rank)))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an in-place broadcast; :func:`synchronize` returns ``tensor``."""
    handle = comm_of(process_set).broadcast_async(tensor.detach(), int(root_rank), inplace=True)
    return AsyncHandle(handle, lambda _: tensor)


# -- alltoall -------------------------------------------------------------------------------------
def _splits_list(splits: Any) -> Optional[list[int]]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(s) for s in splits.reshape(-1).tolist()]
    return [int(s) for s in splits]


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Optional[list[int]], comm: Communicator) -> tuple:
        received = torch.empty(0, dtype=torch.int32)
        if splits is not None or ctx.needs_input_grad[0]:
            sent = splits if splits is not None else [tensor.shape[0] // comm.size] * comm.size
            received = comm.alltoall(torch.tensor(sent, dtype=torch.int32), [1] * comm.size)
        ctx.comm, ctx.received = comm, [int(r) for r in received]
        out = comm.alltoall(tensor.detach(), splits)
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple:
        return ctx.comm.alltoall(grad.contiguous(), ctx.received), None, None


def alltoall(tensor: torch.Tensor, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send block ``i`` of dim 0 to rank ``i``; with ``splits``, return ``(output, received_splits)``."""
    out, received = _AlltoallFn.apply(tensor, _splits_list(splits), comm_of(process_set))
    return (out, received) if splits is not None else out


def alltoall_async(tensor: torch.Tensor, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an alltoall; :func:`synchronize` returns the received rows."""
    return AsyncHandle(comm_of(process_set).alltoall_async(tensor.detach(), _splits_list(splits)))


# -- reducescatter ----------------------------------------------------------------------------------
def _reducescatter_start(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                         comm: Communicator) -> AsyncHandle:
    src = tensor.detach() * prescale if prescale != 1.0 else tensor.detach()
    return AsyncHandle(comm.reduce_scatter_async(src, op),
                       lambda r: r.mul_(postscale) if postscale != 1.0 else r)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                comm: Communicator) -> torch.Tensor:
        ctx.comm, ctx.op, ctx.scale = comm, op, prescale * postscale
        return _reducescatter_start(tensor, op, prescale, postscale, comm).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        full = ctx.comm.allgather(grad.contiguous()) * ctx.scale
        if ctx.op is Average:
            full = full / ctx.comm.size
        return full, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: type[Compressor] = Compression.none, op: Optional[OpLike] = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks (default Average), keep this rank's rows of dim 0 (lowest ranks get extras)."""
    wire, ctx = compression.compress(tensor)
    out = _ReducescatterFn.apply(wire, resolve_op(op), float(prescale_factor), float(postscale_factor),
                                 comm_of(process_set))
    return compression.decompress(out, ctx)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Optional[OpLike] = None,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> AsyncHandle:
    """Start a reducescatter; :func:`synchronize` returns this rank's rows."""
    return _reducescatter_start(tensor, resolve_op(op), float(prescale_factor), float(postscale_factor),
                                comm_of(process_set))
