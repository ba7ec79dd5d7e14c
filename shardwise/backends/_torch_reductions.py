"""Reductions for the ``torch`` backend: allreduce and reduce-scatter on ``torch.distributed``.

Average runs as a sum divided on each rank (floor division for integers).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..core.comm import CompletedHandle, Handle, ReduceOp, split_sizes
from ..core.errors import ShapeMismatchError
from ._torch_handles import _NarrowedHandle, _widened, reduce_scatter_single

__all__ = ["TorchReductions"]

_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
              ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}


class TorchReductions:
    """Mixin for :class:`~shardwise.backends.torch.TorchCommunicator` (uses its members and plumbing)."""

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
        if min(rows) == most and not self._order:
            padded = t.contiguous()  # already one equal block per rank: no copy of the whole input
        else:
            padded = t.new_zeros((most * self._size,) + tuple(t.shape[1:]))
            start, blocks = 0, []
            for n in rows:
                blocks.append(t[start:start + n])
                start += n
            for g, block in enumerate(self._by_group_rank(blocks)):
                padded[g * most: g * most + block.shape[0]] = block
        out = t.new_empty((most,) + tuple(t.shape[1:]))
        engine = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        works = [reduce_scatter_single(out, padded, op=_TORCH_OPS[engine], group=self._group,
                                            async_op=True)]

        def finish() -> Any:
            mine = out[: rows[self._rank]]
            if op is ReduceOp.AVERAGE:
                mine = mine / self._size if mine.is_floating_point() else mine // self._size
            return self._back(mine.contiguous(), was_np)

        return self._done("reduce_scatter", works, finish, blocking)
