"""A communicator wrapper that keeps a flight recorder of its collectives.

:class:`RecordedCommunicator` delegates every call to an inner communicator and
notes each collective in its :class:`~shardwise.core.flight_recorder.FlightRecorder`
(op, name, dtype, shape, sequence number, started/completed/failed, times): a
blocking call ends when it returns, an async one when its handle's ``wait``
returns or ``done()`` first says so. Sub-communicators made by ``split``,
``duplicate`` and ``thread_safe_duplicate`` are recorded too, each in a ring of its
own labelled after its parent (``world/split1``, ``world/dup2``...), and all rings
are registered with the :class:`~shardwise.backends.stall_watch.StallWatch` that
dumps them when a collective stalls. Point-to-point messages are not recorded.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ..core.comm import Communicator, Handle, ReduceOp
from ..core.flight_recorder import CollectiveRecord, FlightRecorder
from ._call_desc import describe_tensor

__all__ = ["RecordedCommunicator"]


class _RecordedHandle(Handle):
    """The inner handle; the record ends when the collective is seen finished."""

    def __init__(self, inner: Handle, recorder: FlightRecorder, record: CollectiveRecord) -> None:
        self._inner, self._recorder, self._record = inner, recorder, record

    def done(self) -> bool:
        finished = self._inner.done()
        if finished:
            self._recorder.end(self._record)
        return finished

    def wait(self, timeout: Optional[float] = None) -> Any:
        try:
            result = self._inner.wait(timeout)
        except BaseException:
            if self._inner.done():
                self._recorder.end(self._record, ok=False)
            raise
        self._recorder.end(self._record)
        return result


class RecordedCommunicator(Communicator):
    """Delegates to ``inner`` and records each collective; ``watch`` holds every ring of the job."""

    def __init__(self, inner: Communicator, watch: Any, group: str = "world") -> None:
        self.inner = inner
        self.backend = inner.backend
        self.watch = watch
        self.recorder = FlightRecorder(group)
        self._children = 0
        watch.register(self.recorder, inner.rank)

    def __getattr__(self, item: str) -> Any:  # backend extras (mpi_comm, chunk_bytes, ...)
        if item.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(item)
        return getattr(self.inner, item)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    # -- recording -------------------------------------------------------------------------
    def _start(self, op: str, tensor: Any, name: Optional[str]) -> CollectiveRecord:
        dtype, shape = describe_tensor(tensor) if tensor is not None else (None, None)
        return self.recorder.start(op, name=name, dtype=dtype, shape=shape)

    def _blocking(self, op: str, tensor: Any, name: Optional[str], call: Callable[[], Any]) -> Any:
        record = self._start(op, tensor, name)
        try:
            result = call()
        except BaseException:
            self.recorder.end(record, ok=False)
            raise
        self.recorder.end(record)
        return result

    def _async(self, op: str, tensor: Any, name: Optional[str], call: Callable[[], Handle]) -> Handle:
        record = self._start(op, tensor, name)
        try:
            handle = call()
        except BaseException:
            self.recorder.end(record, ok=False)
            raise
        return _RecordedHandle(handle, self.recorder, record)

    def _child(self, sub: Optional[Communicator], kind: str) -> Optional["RecordedCommunicator"]:
        self._children += 1  # every member makes its sub-communicators in the same order
        if sub is None:
            return None
        return RecordedCommunicator(sub, self.watch, f"{self.recorder.group}/{kind}{self._children}")

    # -- reductions --------------------------------------------------------------------------
    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *, inplace: bool = False,
                  name: Optional[str] = None) -> Any:
        return self._blocking("allreduce", tensor, name,
                              lambda: self.inner.allreduce(tensor, op, inplace=inplace, name=name))

    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        return self._async("allreduce", tensor, name,
                           lambda: self.inner.allreduce_async(tensor, op, inplace=inplace, name=name))

    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *, name: Optional[str] = None) -> Any:
        return self._blocking("reduce_scatter", tensor, name, lambda: self.inner.reduce_scatter(tensor, op, name=name))

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        return self._async("reduce_scatter", tensor, name,
                           lambda: self.inner.reduce_scatter_async(tensor, op, name=name))

    def reduce_scatter_in_place_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                                      name: Optional[str] = None) -> Handle:
        return self._async("reduce_scatter", tensor, name,
                           lambda: self.inner.reduce_scatter_in_place_async(tensor, op, name=name))

    # -- data movement ---------------------------------------------------------------------------
    def allgather(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Any:
        return self._blocking("allgather", tensor, name,
                              lambda: self.inner.allgather(tensor, name=name, uniform=uniform))

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        return self._async("allgather", tensor, name,
                           lambda: self.inner.allgather_async(tensor, name=name, uniform=uniform))

    def allgather_into(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Any:
        return self._blocking("allgather", tensor, name, lambda: self.inner.allgather_into(out, tensor, name=name))

    def allgather_into_async(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Handle:
        return self._async("allgather", tensor, name, lambda: self.inner.allgather_into_async(out, tensor, name=name))

    def broadcast(self, tensor: Any, root: int = 0, *, inplace: bool = False, name: Optional[str] = None) -> Any:
        return self._blocking("broadcast", tensor, name,
                              lambda: self.inner.broadcast(tensor, root, inplace=inplace, name=name))

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        return self._async("broadcast", tensor, name,
                           lambda: self.inner.broadcast_async(tensor, root, inplace=inplace, name=name))

    def alltoall(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                 recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Any:
        return self._blocking("alltoall", tensor, name, lambda: self.inner.alltoall(tensor, splits, recv_splits=recv_splits, name=name))

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
        return self._async("alltoall", tensor, name, lambda: self.inner.alltoall_async(tensor, splits, recv_splits=recv_splits, name=name))

    # -- point to point (not recorded) -------------------------------------------------------------
    def send(self, tensor: Any, dest: int, tag: int = 0) -> None:
        self.inner.send(tensor, dest, tag)

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        return self.inner.send_async(tensor, dest, tag)

    def recv(self, tensor: Any, source: int, tag: int = 0) -> Any:
        return self.inner.recv(tensor, source, tag)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        return self.inner.recv_async(tensor, source, tag)

    # -- control ---------------------------------------------------------------------------------------
    def barrier(self) -> None:
        self._blocking("barrier", None, None, self.inner.barrier)

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["RecordedCommunicator"]:
        sub = self._blocking("split", None, None, lambda: self.inner.split(color, key, ranks=ranks))
        # Groups of different colours are different groups: their labels differ too.
        return self._child(sub, "split" if color is None else f"split.c{int(color)}.")

    def duplicate(self) -> "RecordedCommunicator":
        return self._child(self._blocking("duplicate", None, None, self.inner.duplicate), "dup")

    def thread_safe_duplicate(self) -> Optional[Communicator]:
        sub = self._blocking("duplicate", None, None, self.inner.thread_safe_duplicate)
        return self._child(sub, "dup")

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._blocking("allgather_object", None, None, lambda: self.inner.allgather_object(obj))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._blocking("broadcast_object", None, None, lambda: self.inner.broadcast_object(obj, root))

    def abort(self, code: int = 1) -> None:
        self.inner.abort(code)

    def free(self) -> None:
        self.watch.unregister(self.recorder)
        self.inner.free()

    def __repr__(self) -> str:
        return f"<RecordedCommunicator group={self.recorder.group} over {self.inner!r}>"
