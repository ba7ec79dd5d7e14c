"""The ``torch`` backend: collectives on ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

numpy arrays are wrapped with ``torch.from_numpy`` (shared memory) and returned as
numpy; torch tensors come back as torch tensors on their own device.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..core.comm import CompletedHandle, Communicator, Handle, ReduceOp, split_sizes
from ..core.errors import (BackendError, CollectiveTimeoutError, ShapeMismatchError, WorkerLostError,
                           is_peer_loss)
from ._arrays import check_first_dim_split

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover
    raise BackendError("the 'torch' backend needs PyTorch: pip install torch") from exc

_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
              ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}


class _WorkHandle(Handle):
    def __init__(self, what: str, works: list, finish: Callable[[], Any],
                 default_timeout: Optional[float]) -> None:
        self._what, self._works, self._finish = what, works, finish
        self._timeout = default_timeout
        self._done, self._result = False, None

    def done(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self, timeout: Optional[float] = None) -> Any:
        if self._done:
            return self._result
        timeout = self._timeout if timeout is None else timeout
        for w in self._works:
            try:
                if timeout is None:
                    w.wait()
                else:
                    w.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as exc:
                if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                    raise CollectiveTimeoutError(
                        f"{self._what} did not complete within {timeout:g} s: at least one rank "
                        "never joined it") from exc
                if is_peer_loss(exc):
                    raise WorkerLostError(f"{self._what}: a rank left the job ({exc})") from exc
                raise
        self._result, self._done = self._finish(), True
        return self._result


#: dtypes gloo cannot move or reduce, and the dtype they travel as (exact for every op: the low
#: bits of an int32 sum, product, min or max are those of the int16 one).
_WIDER = {torch.int16: torch.int32, np.dtype(np.int16): np.dtype(np.int32)}


class _NarrowedHandle(Handle):
    """A collective that ran on a widened copy: cast the result back (and write it in place)."""

    def __init__(self, inner: Handle, original: Any, inplace: bool) -> None:
        self._inner, self._original, self._inplace = inner, original, inplace

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        result = self._inner.wait(timeout)
        if isinstance(self._original, np.ndarray):
            result = result.astype(self._original.dtype)
            if self._inplace:
                np.copyto(self._original, result)
                return self._original
            return result
        result = result.to(self._original.dtype)
        if self._inplace:
            self._original.copy_(result)
            return self._original
        return result


def _widened(tensor: Any) -> Optional[Any]:
    """A copy of ``tensor`` in a dtype gloo handles, or None when it needs none."""
    wider = _WIDER.get(getattr(tensor, "dtype", None))
    if wider is None:
        return None
    return tensor.astype(wider) if isinstance(tensor, np.ndarray) else tensor.to(wider)


class TorchCommunicator(Communicator):
    """A :class:`Communicator` over a ``torch.distributed`` process group."""

    backend = "torch"

    def __init__(self, group: Optional[Any] = None, *, timeout: Optional[float] = None,
                 order: Optional[Sequence[int]] = None) -> None:
        if not dist.is_initialized():
            raise BackendError("torch.distributed is not initialised; call shardwise.init(backend='torch')")
        self._group = group if group is not None else dist.group.WORLD
        self._size = dist.get_world_size(self._group)
        # torch orders group members by global rank; ``order[i]`` is the torch group rank of
        # our rank ``i`` so that split() can honour any member order, as MPI does.
        self._order = list(order) if order is not None and list(order) != list(range(self._size)) else None
        group_rank = dist.get_rank(self._group)
        self._rank = self._order.index(group_rank) if self._order else group_rank
        self.timeout = timeout

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def process_group(self) -> Any:
        """The underlying ``torch.distributed`` group."""
        return self._group

    # -- plumbing ----------------------------------------------------------------------------
    @staticmethod
    def _as_torch(x: Any) -> tuple[Any, bool]:
        if isinstance(x, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(x)), True
        if isinstance(x, torch.Tensor):
            return x.detach(), False
        raise TypeError(f"unsupported tensor type {type(x).__name__}; pass a numpy array or a torch tensor")

    @staticmethod
    def _back(t: Any, was_numpy: bool) -> Any:
        return t.numpy() if was_numpy else t

    @staticmethod
    def _write_back(original: Any, original_t: Any, result: Any, was_numpy: bool) -> Any:
        """Publish an in-place result into ``original`` if the engine worked on a copy."""
        if was_numpy:
            res = result.numpy()
            if not np.shares_memory(original, res):
                np.copyto(original, res)
        elif result is not original_t:
            original_t.copy_(result)
        return original

    def _global(self, peer: int) -> int:
        if not 0 <= peer < self._size:
            raise ValueError(f"rank {peer} is out of range for a group of size {self._size}")
        peer = self._order[peer] if self._order else peer
        return dist.get_global_rank(self._group, peer) if self._group is not dist.group.WORLD else peer

    def _by_group_rank(self, blocks: list) -> list:
        """Reorder per-rank blocks from our rank order to torch's group-rank order."""
        if not self._order:
            return blocks
        out = [None] * self._size
        for i, g in enumerate(self._order):
            out[g] = blocks[i]
        return out

    def _by_our_rank(self, blocks: list) -> list:
        """Reorder per-rank blocks from torch's group-rank order to our rank order."""
        return [blocks[g] for g in self._order] if self._order else blocks

    def _done(self, what: str, works: list, finish: Callable[[], Any], blocking: bool) -> Handle:
        handle = _WorkHandle(what, works, finish, self.timeout)
        return CompletedHandle(handle.wait()) if blocking else handle

    # -- reductions ----------------------------------------------------------------------------
    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                  inplace: bool = False, name: Optional[str] = None) -> Any:
        return self._allreduce(tensor, ReduceOp.parse(op), inplace, True).wait()

    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        inplace: bool = False, name: Optional[str] = None) -> Handle:
        return self._allreduce(tensor, ReduceOp.parse(op), inplace, False)

    def _allreduce(self, tensor: Any, op: ReduceOp, inplace: bool, blocking: bool) -> Handle:
        wide = _widened(tensor)
        if wide is not None:
            return _NarrowedHandle(self._allreduce(wide, op, False, blocking), tensor, inplace)
        t, was_np = self._as_torch(tensor)
        work_t = t.contiguous() if inplace else t.clone(memory_format=torch.contiguous_format)
        if self._size == 1:
            if inplace:
                return CompletedHandle(self._write_back(tensor, t, work_t, was_np))
            return CompletedHandle(self._back(work_t, was_np))
        engine = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        works = [dist.all_reduce(work_t, op=_TORCH_OPS[engine], group=self._group, async_op=True)]

        def finish() -> Any:
            if op is ReduceOp.AVERAGE:
                if work_t.is_floating_point() or work_t.is_complex():
                    work_t.div_(self._size)
                else:
                    work_t.floor_divide_(self._size)
            if inplace:
                return self._write_back(tensor, t, work_t, was_np)
            return self._back(work_t, was_np)

        return self._done("allreduce", works, finish, blocking)

    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                       name: Optional[str] = None) -> Any:
        return self._reduce_scatter(tensor, ReduceOp.parse(op), True).wait()

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        return self._reduce_scatter(tensor, ReduceOp.parse(op), False)

    def _reduce_scatter(self, tensor: Any, op: ReduceOp, blocking: bool) -> Handle:
        wide = _widened(tensor)
        if wide is not None:
            return _NarrowedHandle(self._reduce_scatter(wide, op, blocking), tensor, False)
        t, was_np = self._as_torch(tensor)
        if t.dim() == 0:
            raise ShapeMismatchError("reduce_scatter needs a tensor with at least one dimension")
        rows = split_sizes(t.shape[0], self._size)
        if self._size == 1:
            return CompletedHandle(self._back(t.clone(), was_np))
        most = max(rows)
        padded = t.new_zeros((most * self._size,) + tuple(t.shape[1:]))
        start, blocks = 0, []
        for n in rows:
            blocks.append(t[start:start + n])
            start += n
        for g, block in enumerate(self._by_group_rank(blocks)):
            padded[g * most: g * most + block.shape[0]] = block
        out = t.new_empty((most,) + tuple(t.shape[1:]))
        engine = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        works = [dist.reduce_scatter_tensor(out, padded, op=_TORCH_OPS[engine], group=self._group,
                                            async_op=True)]

        def finish() -> Any:
            mine = out[: rows[self._rank]]
            if op is ReduceOp.AVERAGE:
                mine = mine / self._size if mine.is_floating_point() else mine // self._size
            return self._back(mine.contiguous(), was_np)

        return self._done("reduce_scatter", works, finish, blocking)

    # -- data movement ----------------------------------------------------------------------------
    def allgather(self, tensor: Any, *, name: Optional[str] = None) -> Any:
        return self._allgather(tensor, True).wait()

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None) -> Handle:
        return self._allgather(tensor, False)

    def _allgather(self, tensor: Any, blocking: bool) -> Handle:
        wide = _widened(tensor)
        if wide is not None:
            return _NarrowedHandle(self._allgather(wide, blocking), tensor, False)
        t, was_np = self._as_torch(tensor)
        if t.dim() == 0:
            t = t.reshape(1)
        t = t.contiguous()
        if self._size == 1:
            return CompletedHandle(self._back(t.clone(), was_np))
        rows = self._agree_rows(t)
        most = max(rows)
        if min(rows) == most:
            send = t
        else:
            send = t.new_zeros((most,) + tuple(t.shape[1:]))
            send[: t.shape[0]] = t
        gathered = t.new_empty((most * self._size,) + tuple(t.shape[1:]))
        works = [dist.all_gather_into_tensor(gathered, send, group=self._group, async_op=True)]

        def finish() -> Any:
            if min(rows) == most and not self._order:
                return self._back(gathered, was_np)
            parts = self._by_our_rank([gathered[g * most: g * most + n] for g, n in enumerate(rows)])
            return self._back(torch.cat(parts), was_np)

        return self._done("allgather", works, finish, blocking)

    def _agree_rows(self, t: Any) -> list[int]:
        import zlib

        key = zlib.crc32(repr((tuple(t.shape[1:]), str(t.dtype))).encode()) & 0x7FFFFFFF
        device = t.device if t.device.type != "cpu" and dist.get_backend(self._group) == "nccl" else "cpu"
        mine = torch.tensor([t.shape[0], key], dtype=torch.int64, device=device)
        every = torch.empty(2 * self._size, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every, mine, group=self._group)
        every = every.view(self._size, 2).cpu()
        if len(set(every[:, 1].tolist())) > 1:
            described = self.allgather_object((tuple(t.shape[1:]), str(t.dtype)))
            detail = ", ".join(f"rank {r}: trailing shape {s} {d}" for r, (s, d) in enumerate(described))
            raise ShapeMismatchError(f"allgather: ranks disagree on trailing shape or dtype ({detail})")
        return every[:, 0].tolist()  # in torch group-rank order

    def broadcast(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                  name: Optional[str] = None) -> Any:
        return self._broadcast(tensor, root, inplace, True).wait()

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        return self._broadcast(tensor, root, inplace, False)

    def _broadcast(self, tensor: Any, root: int, inplace: bool, blocking: bool) -> Handle:
        wide = _widened(tensor)
        if wide is not None:
            return _NarrowedHandle(self._broadcast(wide, root, False, blocking), tensor, inplace)
        src = self._global(root)
        t, was_np = self._as_torch(tensor)
        work_t = t.contiguous() if inplace else t.contiguous().clone()
        if self._size == 1:
            return CompletedHandle(tensor if inplace else self._back(work_t, was_np))
        works = [dist.broadcast(work_t, src=src, group=self._group, async_op=True)]

        def finish() -> Any:
            if inplace:
                return self._write_back(tensor, t, work_t, was_np)
            return self._back(work_t, was_np)

        return self._done("broadcast", works, finish, blocking)

    def alltoall(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                 name: Optional[str] = None) -> Any:
        return self._alltoall(tensor, splits, True).wait()

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       name: Optional[str] = None) -> Handle:
        return self._alltoall(tensor, splits, False)

    def _alltoall(self, tensor: Any, splits: Optional[Sequence[int]], blocking: bool) -> Handle:
        wide = _widened(tensor)
        if wide is not None:
            return _NarrowedHandle(self._alltoall(wide, splits, blocking), tensor, False)
        t, was_np = self._as_torch(tensor)
        if t.dim() == 0:
            raise ShapeMismatchError("alltoall needs a tensor with at least one dimension")
        t = t.contiguous()
        if splits is None:
            if t.shape[0] % self._size:
                raise ShapeMismatchError(
                    f"alltoall: dim 0 ({t.shape[0]}) is not divisible by the group size ({self._size}); "
                    "pass splits=")
            send_rows = [t.shape[0] // self._size] * self._size
        else:
            send_rows = [int(s) for s in splits]
            check_first_dim_split(tuple(t.shape), send_rows, self._size, "alltoall")
        if self._size == 1:
            return CompletedHandle(self._back(t.clone(), was_np))
        if self._order:
            blocks, start = [], 0
            for n in send_rows:
                blocks.append(t[start:start + n])
                start += n
            t = torch.cat(self._by_group_rank(blocks))
            send_rows = self._by_group_rank(send_rows)
        counts = torch.tensor(send_rows, dtype=torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self._group)
        recv_rows = recv_counts.tolist()
        out = t.new_empty((sum(recv_rows),) + tuple(t.shape[1:]))
        works = [dist.all_to_all_single(out, t, output_split_sizes=recv_rows, input_split_sizes=send_rows,
                                        group=self._group, async_op=True)]

        def finish() -> Any:
            if not self._order:
                return self._back(out, was_np)
            return self._back(torch.cat(self._by_our_rank(list(torch.split(out, recv_rows)))), was_np)

        return self._done("alltoall", works, finish, blocking)

    # -- point to point -----------------------------------------------------------------------------
    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        t, _ = self._as_torch(tensor)
        work = dist.isend(t.contiguous(), dst=self._global(dest), group=self._group, tag=tag)
        return _WorkHandle("send", [work], lambda: None, self.timeout)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        t, _ = self._as_torch(tensor)
        buf = t if t.is_contiguous() else t.contiguous()
        work = dist.irecv(buf, src=self._global(source), group=self._group, tag=tag)

        def finish() -> Any:
            if buf is not t:
                t.copy_(buf)
            return tensor

        return _WorkHandle(f"recv from rank {source}", [work], finish, self.timeout)

    # -- control ----------------------------------------------------------------------------------------
    def barrier(self) -> None:
        if self._size > 1:
            work = dist.barrier(group=self._group, async_op=True)
            _WorkHandle("barrier", [work], lambda: None, self.timeout).wait()

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["TorchCommunicator"]:
        if (color is None) == (ranks is None):
            raise ValueError("split takes exactly one of color= or ranks=")
        if ranks is not None:
            members = [int(r) for r in ranks]
            if len(set(members)) != len(members) or any(not 0 <= r < self._size for r in members):
                raise ValueError(f"split ranks {members} must be distinct ranks of a group of size {self._size}")
            groups = {0: members}
        else:
            entries = self.allgather_object((int(color), self._rank if key is None else int(key)))
            groups = {}
            for r, (c, k) in sorted(enumerate(entries), key=lambda e: (e[1][0], e[1][1], e[0])):
                groups.setdefault(c, []).append(r)
        mine = None
        # Every rank must create every group, in the same order.
        for c in sorted(groups):
            members = groups[c]
            global_ranks = [self._global(r) for r in members]
            pg = dist.new_group(global_ranks)
            if self._rank in members:
                by_torch = sorted(global_ranks)
                mine = TorchCommunicator(pg, timeout=self.timeout,
                                         order=[by_torch.index(g) for g in global_ranks])
        return mine

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self._group)
        return self._by_our_rank(out)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(root), group=self._group)
        return box[0]

    def abort(self, code: int = 1) -> None:
        import os
        import sys

        sys.stderr.flush()
        os._exit(code)
