"""A communicator wrapper that times every collective for the comm/compute monitor.

Blocking calls count entirely as exposed communication; an async call counts from
its start, but only its ``wait()`` is exposed, so communication hidden behind
compute shows as *overlapped*. With ``SHARDWISE_TIMELINE=trace.json`` every
collective also lands in a Chrome/Perfetto trace.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..core.comm import Communicator, Handle, ReduceOp
from ..core.monitor import CommMonitor

__all__ = ["MonitoredCommunicator", "nbytes_of"]


def nbytes_of(tensor: Any) -> int:
    """Bytes of a numpy array, torch tensor or TF tensor (0 if unknown)."""
    if hasattr(tensor, "nbytes"):
        return int(tensor.nbytes)
    if hasattr(tensor, "element_size") and hasattr(tensor, "numel"):
        return int(tensor.element_size() * tensor.numel())
    return 0


class MonitoredCommunicator(Communicator):
    """Delegates to ``inner`` and reports each collective to ``monitor``."""

    def __init__(self, inner: Communicator, monitor: CommMonitor) -> None:
        self.inner, self.monitor = inner, monitor
        self.backend = inner.backend

    def __getattr__(self, name: str) -> Any:  # backend extras (mpi_comm, chunk_bytes, ...)
        return getattr(self.inner, name)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def _blocking(self, what: str, tensor: Any, call: Any, *args: Any, **kwargs: Any) -> Any:
        with self.monitor.collective(what, nbytes_of(tensor)):
            return call(*args, **kwargs)

    def _async(self, what: str, tensor: Any, handle: Handle) -> Handle:
        return self.monitor.track(what, nbytes_of(tensor), handle)

    @staticmethod
    def _label(kind: str, name: Optional[str]) -> str:
        return f"{kind}.{name}" if name else kind

    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *, inplace: bool = False,
                  name: Optional[str] = None) -> Any:
        return self._blocking(self._label("allreduce", name), tensor, self.inner.allreduce, tensor, op,
                              inplace=inplace, name=name)

    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        return self._async(self._label("allreduce", name), tensor,
                           self.inner.allreduce_async(tensor, op, inplace=inplace, name=name))

    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *, name: Optional[str] = None) -> Any:
        return self._blocking(self._label("reduce_scatter", name), tensor, self.inner.reduce_scatter, tensor, op,
                              name=name)

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        return self._async(self._label("reduce_scatter", name), tensor,
                           self.inner.reduce_scatter_async(tensor, op, name=name))

    def reduce_scatter_in_place_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                                      name: Optional[str] = None) -> Handle:
        return self._async(self._label("reduce_scatter", name), tensor,
                           self.inner.reduce_scatter_in_place_async(tensor, op, name=name))

    def allgather(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Any:
        return self._blocking(self._label("allgather", name), tensor, self.inner.allgather, tensor, name=name,
                              uniform=uniform)

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        return self._async(self._label("allgather", name), tensor,
                           self.inner.allgather_async(tensor, name=name, uniform=uniform))

    def broadcast(self, tensor: Any, root: int = 0, *, inplace: bool = False, name: Optional[str] = None) -> Any:
        return self._blocking(self._label("broadcast", name), tensor, self.inner.broadcast, tensor, root,
                              inplace=inplace, name=name)

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        return self._async(self._label("broadcast", name), tensor,
                           self.inner.broadcast_async(tensor, root, inplace=inplace, name=name))

    def alltoall(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                 recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Any:
        return self._blocking(self._label("alltoall", name), tensor, self.inner.alltoall, tensor, splits,
                              recv_splits=recv_splits, name=name)

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
        return self._async(self._label("alltoall", name), tensor,
                           self.inner.alltoall_async(tensor, splits, recv_splits=recv_splits, name=name))

    def send(self, tensor: Any, dest: int, tag: int = 0) -> None:
        self._blocking(f"send.to{dest}", tensor, self.inner.send, tensor, dest, tag)

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        return self._async(f"send.to{dest}", tensor, self.inner.send_async(tensor, dest, tag))

    def recv(self, tensor: Any, source: int, tag: int = 0) -> Any:
        return self._blocking(f"recv.from{source}", tensor, self.inner.recv, tensor, source, tag)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        return self._async(f"recv.from{source}", tensor, self.inner.recv_async(tensor, source, tag))

    def barrier(self) -> None:
        with self.monitor.collective("barrier", 0):
            self.inner.barrier()

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["MonitoredCommunicator"]:
        sub = self.inner.split(color, key, ranks=ranks)
        return None if sub is None else MonitoredCommunicator(sub, self.monitor)

    def duplicate(self) -> "MonitoredCommunicator":
        return MonitoredCommunicator(self.inner.duplicate(), self.monitor)

    def thread_safe_duplicate(self) -> Optional[Communicator]:
        """The wrapped communicator's, unmonitored (the monitor times this thread's collectives)."""
        return self.inner.thread_safe_duplicate()

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.inner.allgather_object(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.inner.broadcast_object(obj, root)

    def abort(self, code: int = 1) -> None:
        self.inner.abort(code)

    def free(self) -> None:
        self.inner.free()
