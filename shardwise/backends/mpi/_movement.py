"""Data movement for the ``mpi`` backend: allgather, broadcast and alltoall, as raw bytes.

Every rank's dim-0 size is agreed first (:meth:`MPIMovement._agree_rows`), so first
dimensions may differ while trailing shapes and dtypes must match; an allgather with
``uniform=True`` skips that agreement.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ...core.comm import CompletedHandle, Handle
from ...core.errors import ShapeMismatchError
from .._arrays import HostView, alltoall_rows, empty_like_host, finalize, host_view
from ._base import MPI, _bytes, _shape_key

__all__ = ["MPIMovement"]


class MPIMovement:
    """Mixin for :class:`~shardwise.backends.mpi.MPICommunicator` (uses its members and plumbing)."""

    # -- allgather --------------------------------------------------------------------
    def allgather(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Any:
        return self._blocking("allgather", lambda: self._allgather(tensor, True, uniform).wait())

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        return self._async("allgather", lambda: self._allgather(tensor, True, uniform).wait(),
                           lambda: self._allgather(tensor, False, uniform))

    def _allgather(self, tensor: Any, blocking: bool, uniform: bool = False) -> Handle:
        src = host_view(tensor)
        shape = tuple(src.array.shape)
        if not shape:
            src = HostView(src.array.reshape(1), src.logical, src.writeback)
            shape = (1,)
        # Equal shapes are promised: no blocking Allgather of row counts before the Iallgatherv.
        rows = [shape[0]] * self._size if uniform else self._agree_rows("allgather", shape, src.logical)
        out, dst = empty_like_host(tensor, (sum(rows),) + shape[1:])
        if self._size == 1:
            np.copyto(dst.array.reshape(-1), src.array.reshape(-1))
            dst.publish()
            return CompletedHandle(finalize(out))
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * src.array.itemsize
        counts = [r * row_bytes for r in rows]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
        send, recv = _bytes(src.array), _bytes(dst.array)
        spec = [recv, counts, displs, MPI.BYTE]

        def start(block: bool) -> list:
            if block:
                self._comm.Allgatherv([send, MPI.BYTE], spec)
                return []
            return [self._comm.Iallgatherv([send, MPI.BYTE], spec)]

        def finish() -> Any:
            dst.publish()
            return finalize(out)

        return self._run("allgather", start, finish, blocking)

    def allgather_into(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Any:
        return self.allgather_into_async(out, tensor, name=name).wait()

    def allgather_into_async(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Handle:
        """Gather straight into ``out``: one ``Allgather`` (in place when ``tensor`` is this rank's block).

        Open MPI's in-place allgather of a ZeRO unit runs twice as fast as gathering into a
        new buffer, and several times faster than that plus the copy into ``out``.
        """
        src, dst = host_view(tensor), host_view(out)
        if (src.writeback is not None or dst.writeback is not None or src.array.ndim == 0
                or src.array.dtype != dst.array.dtype or not dst.array.flags.writeable
                or dst.array.shape != (src.array.shape[0] * self._size,) + src.array.shape[1:]):
            return super().allgather_into_async(out, tensor, name=name)
        send, recv = _bytes(src.array), _bytes(dst.array)
        own = recv[self._rank * send.size:(self._rank + 1) * send.size]
        in_place = own.__array_interface__["data"][0] == send.__array_interface__["data"][0]
        if not in_place and np.shares_memory(send, recv):
            return super().allgather_into_async(out, tensor, name=name)  # MPI forbids aliased buffers
        if self._size == 1:
            if not in_place:
                np.copyto(own, send)
            return CompletedHandle(out)

        def start(block: bool) -> list:
            sbuf = MPI.IN_PLACE if in_place else [send, MPI.BYTE]
            if block:
                self._comm.Allgather(sbuf, [recv, MPI.BYTE])
                return []
            return [self._comm.Iallgather(sbuf, [recv, MPI.BYTE])]

        return self._async("allgather", lambda: self._run("allgather", start, lambda: out, True).wait(),
                           lambda: self._run("allgather", start, lambda: out, False))

    def _agree_rows(self, what: str, shape: tuple[int, ...], dtype: str) -> list[int]:
        """Gather every rank's dim-0 size; refuse differing trailing shapes or dtypes."""
        if self._size == 1:
            return [shape[0]]
        mine = np.array([shape[0], _shape_key(shape[1:], dtype)], dtype=np.int64)
        every = np.empty((self._size, 2), dtype=np.int64)
        self._comm.Allgather(mine, every)
        if len(set(every[:, 1].tolist())) > 1:
            described = self.allgather_object((shape[1:], dtype))
            detail = ", ".join(f"rank {r}: trailing shape {s} {d}" for r, (s, d) in enumerate(described))
            raise ShapeMismatchError(f"{what}: ranks disagree on trailing shape or dtype ({detail})")
        return every[:, 0].tolist()

    # -- broadcast ----------------------------------------------------------------------
    def broadcast(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                  name: Optional[str] = None) -> Any:
        return self._blocking("broadcast", lambda: self._broadcast(tensor, root, inplace, True).wait())

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        self._check_peer(root, "broadcast root")
        return self._async("broadcast", lambda: self._broadcast(tensor, root, inplace, True).wait(),
                           lambda: self._broadcast(tensor, root, inplace, False))

    def _broadcast(self, tensor: Any, root: int, inplace: bool, blocking: bool) -> Handle:
        self._check_peer(root, "broadcast root")
        src = host_view(tensor)
        if inplace:
            out, dst = tensor, src
        else:
            out, dst = empty_like_host(tensor, tuple(src.array.shape))
            if self._rank == root or self._size == 1:
                np.copyto(dst.array, src.array)
        if self._size == 1:
            dst.publish()
            return CompletedHandle(finalize(out))
        buf = [_bytes(dst.array), MPI.BYTE]

        def start(block: bool) -> list:
            if block:
                self._comm.Bcast(buf, root=root)
                return []
            return [self._comm.Ibcast(buf, root=root)]

        def finish() -> Any:
            dst.publish()
            return finalize(out)

        return self._run("broadcast", start, finish, blocking)

    # -- alltoall ------------------------------------------------------------------------
    def alltoall(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                 recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Any:
        return self._blocking("alltoall", lambda: self._alltoall(tensor, splits, True).wait())

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
        return self._async("alltoall", lambda: self._alltoall(tensor, splits, True).wait(),
                           lambda: self._alltoall(tensor, splits, False))

    def _alltoall(self, tensor: Any, splits: Optional[Sequence[int]], blocking: bool) -> Handle:
        src = host_view(tensor)
        shape = tuple(src.array.shape)
        send_rows = alltoall_rows(shape, splits, self._size)
        if self._size == 1:
            out, dst = empty_like_host(tensor, shape)
            np.copyto(dst.array, src.array)
            dst.publish()
            return CompletedHandle(finalize(out))
        recv_rows = np.empty(self._size, dtype=np.int64)
        self._comm.Alltoall(np.asarray(send_rows, dtype=np.int64), recv_rows)
        out, dst = empty_like_host(tensor, (int(recv_rows.sum()),) + shape[1:])
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * src.array.itemsize
        scounts = [r * row_bytes for r in send_rows]
        rcounts = [int(r) * row_bytes for r in recv_rows]
        sdispl = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(np.int64).tolist()
        rdispl = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).astype(np.int64).tolist()
        sspec = [_bytes(src.array), scounts, sdispl, MPI.BYTE]
        rspec = [_bytes(dst.array), rcounts, rdispl, MPI.BYTE]

        def start(block: bool) -> list:
            if block:
                self._comm.Alltoallv(sspec, rspec)
                return []
            return [self._comm.Ialltoallv(sspec, rspec)]

        def finish() -> Any:
            dst.publish()
            return finalize(out)

        return self._run("alltoall", start, finish, blocking)
