"""An in-process group of communicators, one per thread, for testing wrapper logic without MPI."""

from __future__ import annotations

import collections
import copy
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from shardwise.core.comm import CompletedHandle, Communicator, Handle, ReduceOp
from shardwise.core.errors import CollectiveTimeoutError


class _Shared:
    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.rounds: dict[int, dict[int, Any]] = collections.defaultdict(dict)
        self.mail: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(collections.deque)


class _RecvHandle(Handle):
    def __init__(self, shared: _Shared, key: tuple[int, int, int], buf: np.ndarray) -> None:
        self._shared, self._key, self._buf = shared, key, buf

    def done(self) -> bool:
        with self._shared.cond:
            return bool(self._shared.mail[self._key])

    def wait(self, timeout: Optional[float] = None) -> Any:
        with self._shared.cond:
            if not self._shared.cond.wait_for(lambda: bool(self._shared.mail[self._key]), timeout or 10):
                raise CollectiveTimeoutError(f"fake recv {self._key} never satisfied")
            np.copyto(self._buf, self._shared.mail[self._key].popleft())
        return self._buf


class FakeComm(Communicator):
    """Rank ``rank`` of a thread group; collectives meet by per-rank call count."""

    backend = "fake"

    def __init__(self, shared: _Shared, rank: int) -> None:
        self._shared, self._rank, self._calls = shared, rank, 0
        self.timeout: Optional[float] = None
        self.log: list[str] = []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._shared.size

    def _meet(self, kind: str, value: Any) -> list[Any]:
        self.log.append(kind)
        call, self._calls = self._calls, self._calls + 1
        sh = self._shared
        with sh.cond:
            sh.rounds[call][self._rank] = (kind, copy.deepcopy(value))
            sh.cond.notify_all()
            if not sh.cond.wait_for(lambda: len(sh.rounds[call]) == sh.size, 10):
                raise TimeoutError(f"fake {kind} #{call}: not every rank came")
            entries = [sh.rounds[call][r] for r in range(sh.size)]
        kinds = {k for k, _ in entries}
        if len(kinds) > 1:
            raise RuntimeError(f"fake engine: mismatched collectives {sorted(kinds)} (would corrupt or hang)")
        return [v for _, v in entries]

    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        inplace: bool = False, name: Optional[str] = None) -> Handle:
        parts = self._meet("allreduce", np.asarray(tensor))
        return CompletedHandle(np.sum(parts, axis=0))

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        total = np.sum(self._meet("reduce_scatter", np.asarray(tensor)), axis=0)
        return CompletedHandle(np.array_split(total, self.size)[self._rank])

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        return CompletedHandle(np.concatenate(self._meet("allgather", np.asarray(tensor))))

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        return CompletedHandle(self._meet("broadcast", np.asarray(tensor))[root])

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       name: Optional[str] = None) -> Handle:
        parts = self._meet("alltoall", np.asarray(tensor))
        return CompletedHandle(np.concatenate([np.array_split(p, self.size)[self._rank] for p in parts]))

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        with self._shared.cond:
            self._shared.mail[(self._rank, dest, tag)].append(np.array(tensor, copy=True))
            self._shared.cond.notify_all()
        return CompletedHandle(None)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        return _RecvHandle(self._shared, (source, self._rank, tag), tensor)

    def barrier(self) -> None:
        self._meet("barrier", None)

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["Communicator"]:
        self._meet("split", None)
        return self  # enough for wrapper tests: the "sub-group" is the group itself

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._meet("allgather_object", obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._meet("broadcast_object", obj)[root]

    def abort(self, code: int = 1) -> None:
        raise SystemExit(code)


def run_group(size: int, body: Callable[[FakeComm], Any], *, join_timeout: float = 20) -> list[Any]:
    """Run ``body(comm)`` on ``size`` threads; return each rank's result or raised exception."""
    shared = _Shared(size)
    results: list[Any] = [None] * size

    def main(rank: int) -> None:
        try:
            results[rank] = body(FakeComm(shared, rank))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(size)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, join_timeout - (time.monotonic() - start)))
    if any(t.is_alive() for t in threads):
        raise AssertionError("a fake rank hung")
    return results


class FakeStore:
    """The few ``torch.distributed.Store`` methods the store handshake uses, shared by threads."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def wait(self, keys: list[str], timeout: Any) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: all(k in self.data for k in keys), timeout.total_seconds()):
                raise RuntimeError(f"Wait timeout after {timeout}, keys: {keys}")

    def check(self, keys: list[str]) -> bool:
        with self.cond:
            return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self.cond:
            return [self.data[k] for k in keys]

    def delete_key(self, key: str) -> bool:
        with self.cond:
            return self.data.pop(key, None) is not None
