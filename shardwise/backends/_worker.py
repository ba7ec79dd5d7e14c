"""A background thread that runs one communicator's collectives in issue order.

Non-blocking MPI collectives use slower algorithms than the blocking ones and,
without an MPI progress thread, only advance while the caller is inside MPI. Like
Horovod's background thread, the ``mpi`` backend instead runs each async
collective as a *blocking* call on this thread: the fast algorithms run while the
caller computes. A blocking call issued while work is queued goes through the same
queue, so every rank sees its collectives in the order it issued them.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Optional

from ..core.comm import Handle
from ..core.errors import CollectiveTimeoutError
from ._device_staging import caller_stream


class FutureHandle(Handle):
    """A collective running on the worker thread."""

    def __init__(self, future: concurrent.futures.Future, what: str, default_timeout: Optional[float]) -> None:
        self._future, self._what, self._timeout = future, what, default_timeout

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        timeout = self._timeout if timeout is None else timeout
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise CollectiveTimeoutError(f"{self._what} did not complete within {timeout:g} s: at least one "
                                         "rank never joined it") from None


def _released_before_result(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn``, dropped as soon as it returns, run on the submitting thread's CUDA stream.

    The executor publishes the result before it lets go of the call, so a waiter could
    otherwise resume while the call's closure still holds the collective's buffers. The
    stream matters for CUDA tensors, whose host staging is ordered on the current stream.
    """
    box, on_stream = [fn], caller_stream()

    def call() -> Any:
        with on_stream():
            return box.pop()()

    return call


class OrderedWorker:
    """One daemon thread executing submitted calls strictly in submission order."""

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # A count, not the last future: a future holds its result (an in-place reduction's result
        # is a view of the caller's whole buffer), which must go when its handle does.
        self._pending = 0
        self._lock = threading.Lock()

    def busy(self) -> bool:
        """True while a submitted call has not finished."""
        return self._pending > 0

    def _finished(self, _future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1

    def submit(self, fn: Callable[[], Any], what: str, timeout: Optional[float]) -> FutureHandle:
        with self._lock:
            self._pending += 1
            future = self._pool.submit(_released_before_result(fn))
        future.add_done_callback(self._finished)
        return FutureHandle(future, what, timeout)

    def run(self, fn: Callable[[], Any], what: str, timeout: Optional[float]) -> Any:
        """Run a blocking call now, or after the queued ones when any are pending."""
        if self.busy():
            return self.submit(fn, what, timeout).wait()
        return fn()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
