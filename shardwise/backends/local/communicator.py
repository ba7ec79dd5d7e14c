"""The ``local`` backend: a group of one process, so scripts run with no launcher.

Every collective over a single rank is the identity; results are still fresh
copies (out-of-place) so code behaves the same as on a real group.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from ...core.comm import CompletedHandle, Communicator, Handle, ReduceOp
from ...core.errors import ShapeMismatchError
from .._arrays import alltoall_rows, empty_like_host, finalize, host_view
from .._group import split_members


class LocalCommunicator(Communicator):
    """A :class:`Communicator` of size 1."""

    backend = "local"

    def __init__(self) -> None:
        self._mailbox: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.timeout: Optional[float] = None

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    @staticmethod
    def _copy(tensor: Any, shape: Optional[tuple[int, ...]] = None) -> Any:
        src = host_view(tensor)
        out, dst = empty_like_host(tensor, shape if shape is not None else tuple(src.array.shape))
        np.copyto(dst.array.reshape(-1), src.array.reshape(-1))
        dst.publish()
        return finalize(out)

    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        inplace: bool = False, name: Optional[str] = None) -> Handle:
        ReduceOp.parse(op)
        return CompletedHandle(tensor if inplace else self._copy(tensor))

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        ReduceOp.parse(op)
        if not tuple(tensor.shape):
            raise ShapeMismatchError("reduce_scatter needs a tensor with at least one dimension")
        return CompletedHandle(self._copy(tensor))

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        shape = tuple(int(d) for d in tensor.shape) or (1,)
        return CompletedHandle(self._copy(tensor, shape))

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        self._check_peer(root)
        return CompletedHandle(tensor if inplace else self._copy(tensor))

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
        shape = tuple(int(d) for d in tensor.shape)
        alltoall_rows(shape, splits, 1)
        return CompletedHandle(self._copy(tensor))

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        self._check_peer(dest)
        self._mailbox[tag].append(self._copy(tensor))
        return CompletedHandle(None)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        self._check_peer(source)
        if not self._mailbox[tag]:
            raise RuntimeError(f"recv from rank 0 with tag {tag} on a single-process group: nothing was sent")
        message = host_view(self._mailbox[tag].popleft())
        view = host_view(tensor)
        if message.array.nbytes != view.array.nbytes:
            raise ShapeMismatchError(
                f"recv buffer holds {view.array.nbytes} bytes but the message has {message.array.nbytes}")
        np.copyto(view.array.reshape(-1).view(np.uint8), message.array.reshape(-1).view(np.uint8))
        view.publish()
        return CompletedHandle(tensor)

    def barrier(self) -> None:
        return None

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["LocalCommunicator"]:
        members = split_members(1, color, ranks)
        return LocalCommunicator() if members is None or members else None

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check_peer(root)
        return obj

    def abort(self, code: int = 1) -> None:
        sys.stderr.flush()
        os._exit(code)

    @staticmethod
    def _check_peer(peer: int) -> None:
        if peer != 0:
            raise ValueError(f"rank {peer} is out of range for a group of size 1")
