"""Async handles for the torch collectives: :class:`AsyncHandle`, :func:`synchronize`, :func:`poll`.

``*_async`` calls in :mod:`shardwise.adapters.torch.ops` return an :class:`AsyncHandle`
around the coordinator's future; import these names from there.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["AsyncHandle", "synchronize", "poll"]


class AsyncHandle:
    """A collective in flight; :func:`synchronize` returns its result, :func:`poll` says if it is done."""

    def __init__(self, future: Any, finish: Callable[[Any], Any] = lambda r: r) -> None:
        self._future, self._finish = future, finish
        self._done, self._result = False, None

    def wait(self) -> Any:
        """Complete the collective and return its result."""
        if not self._done:
            self._result, self._done = self._finish(self._future.wait()), True
            self._future = None
        return self._result

    def done(self) -> bool:
        """True when :meth:`wait` would not block."""
        return self._done or self._future.done()


def synchronize(handle: Any) -> Any:
    """Wait for an async collective and return its output."""
    if isinstance(handle, AsyncHandle):
        return handle.wait()
    if callable(handle):  # sparse_allreduce_async returns a closure, as in Horovod
        return handle()
    raise ValueError(f"synchronize() takes a handle from an *_async call, got {type(handle).__name__}")


def poll(handle: AsyncHandle) -> bool:
    """True when the async collective behind ``handle`` has completed."""
    if not isinstance(handle, AsyncHandle):
        raise ValueError(f"poll() takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.done()
