"""The ``mpi`` backend: collectives on mpi4py's buffer API.

numpy arrays and CPU torch tensors travel zero-copy (data movement as raw bytes,
reductions on the native MPI type). float16/bfloat16 reductions run in float32
since MPI has no half types. Large allreduces are cut into cache-sized pieces,
which MPI reduces markedly faster than one huge buffer.

The communicator is assembled from mixins, one job each: :mod:`._base`
(mpi4py import, op tables, plumbing), :mod:`._reductions` (allreduce,
reduce-scatter), :mod:`._movement` (allgather, broadcast, alltoall) and
:mod:`._mpi_p2p` (send, recv); this module holds the communicator itself, its
control calls (barrier, split, object collectives, abort, free) and :func:`world`.
:mod:`._device_route` (listed first) sends device tensors to a torch NCCL group
when :func:`shardwise.init` gave the communicator one.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from ...core.comm import CompletedHandle, Communicator, Handle, ReduceOp, split_sizes  # noqa: F401
from ...core.errors import BackendError, ShapeMismatchError  # noqa: F401
from .._arrays import HostView, empty_like_host, finalize, host_view, check_first_dim_split  # noqa: F401
from .._handles import PollingHandle
from .._group import GroupMember, split_members
from .._worker import OrderedWorker
from .._reduce import UPCAST, divide, engine_op, from_work, to_work  # noqa: F401
from ._halving import halving_group
# The mpi4py import (a BackendError without it), and the names this module held before the split.
from ._base import (DEFAULT_CHUNK_BYTES, _MPI_OPS, _NATIVE, _OPS, MPI, MPIPlumbing,  # noqa: F401
                        _bytes, _shape_key)
from ._device_route import DeviceRoute, DeviceRouting
from ._movement import MPIMovement
from ._p2p import MPIPointToPoint
from ._reductions import MPIReductions


class MPICommunicator(DeviceRouting, MPIReductions, MPIMovement, MPIPointToPoint, MPIPlumbing, GroupMember,
                      Communicator):
    """A :class:`Communicator` over an ``mpi4py.MPI.Comm`` (``COMM_WORLD`` by default)."""

    backend = "mpi"

    def __init__(self, comm: Optional[Any] = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout: Optional[float] = None, async_thread: Optional[bool] = None,
                 device_route: Optional[DeviceRoute] = None) -> None:
        self._route = device_route
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
        # Large averages of a power-of-two group run as halving/doubling (_halving) on a
        # duplicate, so that their messages never match the user's on ``self._comm``.
        self._halves = self._comm.Dup() if halving_group(self._size) else None

    @property
    def mpi_comm(self) -> Any:
        """The underlying ``mpi4py`` communicator."""
        return self._comm

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
        members = split_members(self._size, color, ranks)
        if members is not None:
            inside = self._rank in members
            color = 0 if inside else MPI.UNDEFINED
            key = members.index(self._rank) if inside else 0
        key = self._rank if key is None else key
        sub = self._blocking("split", lambda: self._comm.Split(color, key))
        route = None
        if self._route is not None:
            entries = self.allgather_object((int(color), int(key), MPI.COMM_WORLD.Get_rank()))
            route = self._route_split(entries, spans_job=self._size == MPI.COMM_WORLD.Get_size())
        if sub == MPI.COMM_NULL:
            return None
        return MPICommunicator(sub, chunk_bytes=self.chunk_bytes, timeout=self.timeout, device_route=route)

    def duplicate(self) -> "MPICommunicator":
        if self._route is not None and self._size < MPI.COMM_WORLD.Get_size():
            route = self._route.take_spare() or self._route_duplicate()
            dup = self._blocking("duplicate", self._comm.Dup)
            return MPICommunicator(dup, chunk_bytes=self.chunk_bytes, timeout=self.timeout, device_route=route)
        return super().duplicate()

    def thread_safe_duplicate(self) -> Optional["MPICommunicator"]:
        """Collective: ``MPI_Comm_dup`` of this communicator when MPI runs at ``MPI_THREAD_MULTIPLE`` on
        every rank (mpi4py asks for it at ``MPI_Init_thread`` unless ``mpi4py.rc.thread_level`` says
        otherwise), else ``None`` on every rank: below that level MPI forbids calls from two threads
        at once. The duplicate has no device route (host objects and tensors go through MPI) and
        runs its calls in the calling thread (no worker thread of its own).
        """
        multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if not all(self.allgather_object(multiple)):
            return None
        dup = self._blocking("duplicate", self._comm.Dup)
        return MPICommunicator(dup, chunk_bytes=self.chunk_bytes, timeout=self.timeout, async_thread=False)

    def set_device_route(self, route: Optional[DeviceRoute]) -> None:
        """Send this communicator's device tensors through ``route`` (``None``: through MPI).

        Collective in effect: every rank must give the same kind of route.
        """
        self._route = route

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._blocking("allgather_object", lambda: self._comm.allgather(obj))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check_peer(root, "broadcast root")
        return self._blocking("broadcast_object", lambda: self._comm.bcast(obj, root=root))

    def abort(self, code: int = 1) -> None:
        self._comm.Abort(code)

    def free(self) -> None:
        if self._route is not None:
            self._route.free()
            self._route = None
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._halves is not None and not MPI.Is_finalized():
            self._halves.Free()
        self._halves = None
        if self._comm not in (MPI.COMM_NULL, MPI.COMM_WORLD, MPI.COMM_SELF) and not MPI.Is_finalized():
            self._comm.Free()
            self._comm = MPI.COMM_NULL


def world() -> MPICommunicator:
    """A communicator over a duplicate of ``MPI.COMM_WORLD``."""
    return MPICommunicator()
