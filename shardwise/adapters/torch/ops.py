"""Horovod's tensor collectives for torch (``hvd.allreduce`` and friends) on any shardwise backend.

Every call is a named request to the process set's
:class:`~shardwise.adapters.coordinator.Coordinator`, which matches it with the
other ranks' by name, checks that they agree (shapes, dtypes, op, root, ...) and
runs it; a disagreement raises the same error on every rank and the ranks stay in
step. Out-of-place calls are differentiable like Horovod's (the backward of an
allreduce is an allreduce of the gradient, and so on). ``*_async`` calls return
an :class:`AsyncHandle` for :func:`synchronize` and :func:`poll`; ``grouped_*``
calls move a list of tensors as one request.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from shardwise.core.comm import Communicator, ReduceOp
from shardwise.core.negotiation import RequestMeta, Response

from ..coordinator import Coordinator, Future
from ..hvd_ops import Adasum, Average, Max, Min, OpLike, Product, Sum, resolve_op
from ..process_sets import ProcessSet, coordinator_of, global_process_set
from .compression import Compression, Compressor

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "AsyncHandle", "resolve_op",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
           "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async",
           "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
           "sparse_allreduce_async", "synchronize", "poll", "barrier", "join"]

class AsyncHandle:
    """A collective in flight; :func:`synchronize` returns its result, :func:`poll` says if it is done."""

    def __init__(self, future: Any, finish: Callable[[Any], Any] = lambda r: r) -> None:
        self._future, self._finish = future, finish
        self._done, self._result = False, None

    def wait(self) -> Any:
        """Complete the collective and return its result."""
        if not self._done:
            self._result, self._done = self._finish(self._future.wait()), True
            self._future = None
        return self._result

    def done(self) -> bool:
        """True when :meth:`wait` would not block."""
        return self._done or self._future.done()


def synchronize(handle: Any) -> Any:
    """Wait for an async collective and return its output."""
    if isinstance(handle, AsyncHandle):
        return handle.wait()
    if callable(handle):  # sparse_allreduce_async returns a closure, as in Horovod
        return handle()
    raise ValueError(f"synchronize() takes a handle from an *_async call, got {type(handle).__name__}")


def poll(handle: AsyncHandle) -> bool:
    """True when the async collective behind ``handle`` has completed."""
    if not isinstance(handle, AsyncHandle):
        raise ValueError(f"poll() takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.done()


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
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, prescale, postscale, _, process_set = ctx.spec
        grads = [g.contiguous() for g in grads]
        return (None, *_allreduce_submit(grads, op, prescale, postscale, None, process_set).wait())


def _spec(op: Any, average: Optional[bool], prescale: float, postscale: float, name: Optional[str],
          process_set: ProcessSet) -> tuple:
    return (resolve_op(op, average), float(prescale), float(postscale), name, process_set)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Optional[OpLike] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over the process set (default op: Average)."""
    wire, ctx = compression.compress(tensor)
    out, = _GroupedAllreduceFn.apply(_spec(op, average, prescale_factor, postscale_factor, name, process_set),
                                     wire)
    return compression.decompress(out, ctx)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an out-of-place allreduce; :func:`synchronize` returns the reduced tensor."""
    spec = _spec(op, average, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_allreduce_submit([tensor], *spec), lambda r: r[0])


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an in-place allreduce; :func:`synchronize` returns ``tensor``."""
    spec = _spec(op, average, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_allreduce_submit([tensor], *spec, outputs=[tensor]), lambda r: r[0])


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: type[Compressor] = Compression.none,
                      op: Optional[OpLike] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """New tensors: each of ``tensors`` reduced, all in one fused request."""
    packed = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduceFn.apply(_spec(op, average, prescale_factor, postscale_factor, name, process_set),
                                     *[w for w, _ in packed])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed)]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[OpLike] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start a grouped out-of-place allreduce; :func:`synchronize` returns the list of results."""
    spec = _spec(op, average, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_allreduce_submit(list(tensors), *spec))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[OpLike] = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce ``tensors`` in place, as one request, and return them."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[OpLike] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start a grouped in-place allreduce; :func:`synchronize` returns ``tensors``."""
    spec = _spec(op, average, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_allreduce_submit(list(tensors), *spec, outputs=list(tensors)))


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
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ps = ctx.process_set
        reduced = _allreduce_submit([g.contiguous() for g in grads], Average, 1.0, 1.0, None, ps).wait()
        dims = _allgather_submit([torch.tensor(ctx.dims, dtype=torch.int64)], None, ps).wait()[0]
        dims = dims.view(-1, len(ctx.dims))
        me = coordinator_of(ps).comm.rank
        offsets = dims[:me].sum(dim=0) if me else torch.zeros(len(ctx.dims), dtype=torch.int64)
        return (None, *[r.narrow(0, int(o), d) for r, o, d in zip(reduced, offsets, ctx.dims)])


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 (first dimensions may differ)."""
    return _GroupedAllgatherFn.apply((name, process_set), tensor)[0]


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an allgather; :func:`synchronize` returns the concatenation."""
    return AsyncHandle(_allgather_submit([tensor], name, process_set), lambda r: r[0])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each of ``tensors``, as one request."""
    return list(_GroupedAllgatherFn.apply((name, process_set), *tensors))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start a grouped allgather; :func:`synchronize` returns the list of results."""
    return AsyncHandle(_allgather_submit(list(tensors), name, process_set))


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
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = _allreduce_submit([grad.contiguous()], Average, 1.0, 1.0, None, ctx.process_set).wait()[0]
        if coordinator_of(ctx.process_set).comm.rank != _set_relative_root(ctx.root, ctx.process_set):
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor``."""
    return _BroadcastFn.apply(tensor, int(root_rank), name, process_set)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an out-of-place broadcast."""
    return AsyncHandle(_broadcast_submit(tensor, int(root_rank), name, process_set, False))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an in-place broadcast; :func:`synchronize` returns ``tensor``."""
    return AsyncHandle(_broadcast_submit(tensor, int(root_rank), name, process_set, True), lambda _: tensor)


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
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple:
        out, _ = _alltoall_submit(grad.contiguous(), ctx.received, None, ctx.process_set).wait()
        return out, None, None, None


def alltoall(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send block ``i`` of dim 0 to rank ``i``; with ``splits``, return ``(output, received_splits)``."""
    out, received = _AlltoallFn.apply(tensor, splits, name, process_set)
    return (out, received) if splits is not None else out


def alltoall_async(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start an alltoall; :func:`synchronize` returns the rows (and received splits, given ``splits``)."""
    return AsyncHandle(_alltoall_submit(tensor, splits, name, process_set),
                       (lambda r: r) if splits is not None else (lambda r: r[0]))


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
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, prescale, postscale, _, process_set = ctx.spec
        full = _allgather_submit([g.contiguous() for g in grads], None, process_set).wait()
        # Horovod's gradient: the gathered gradient, times the set size for Sum (as allreduce's is).
        scale = prescale * postscale * (coordinator_of(process_set).comm.size if op is Sum else 1)
        return (None, *[_scale(f, scale) for f in full])


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: type[Compressor] = Compression.none, op: Optional[OpLike] = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks (default Average), keep this rank's rows of dim 0 (lowest ranks get extras)."""
    wire, ctx = compression.compress(tensor)
    out, = _GroupedReducescatterFn.apply(_spec(op, None, prescale_factor, postscale_factor, name, process_set),
                                         wire)
    return compression.decompress(out, ctx)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Optional[OpLike] = None,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> AsyncHandle:
    """Start a reducescatter; :func:`synchronize` returns this rank's rows."""
    spec = _spec(op, None, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_reducescatter_submit([tensor], *spec), lambda r: r[0])


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: type[Compressor] = Compression.none, op: Optional[OpLike] = None,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each of ``tensors``, as one request."""
    packed = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatterFn.apply(_spec(op, None, prescale_factor, postscale_factor, name, process_set),
                                         *[w for w, _ in packed])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Optional[OpLike] = None, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> AsyncHandle:
    """Start a grouped reducescatter; :func:`synchronize` returns the list of results."""
    spec = _spec(op, None, prescale_factor, postscale_factor, name, process_set)
    return AsyncHandle(_reducescatter_submit(list(tensors), *spec))


# -- sparse, barrier, join ----------------------------------------------------------------------------
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


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` reaches the barrier (negotiated like other requests)."""
    def execute(comm: Communicator, response: Response) -> None:
        comm.barrier()

    _submit("barrier", None, [], process_set, execute).wait()


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces with zeros until all have joined.

    Returns the rank that joined last (the same on every rank).
    """
    return coordinator_of(global_process_set).join().wait()
