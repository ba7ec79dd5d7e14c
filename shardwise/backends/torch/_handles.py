"""Handles for the ``torch`` backend, and the widened round trip for dtypes gloo lacks.

``_WorkHandle`` waits on ``torch.distributed`` work objects and turns timeouts and
lost peers into shardwise errors; ``_widened`` copies an int16 tensor to int32 and
``_NarrowedHandle`` casts the result back. Used by
:class:`~shardwise.backends.torch.TorchCommunicator` and its mixins.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from ...core.comm import Handle
from ...core.errors import CollectiveTimeoutError, WorkerLostError, is_peer_loss


class _WorkHandle(Handle):
    def __init__(self, what: str, works: list, finish: Callable[[], Any],
                 default_timeout: Optional[float]) -> None:
        self._what, self._works, self._finish = what, works, finish
        self._timeout = default_timeout
        self._done, self._result = False, None

    def done(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self, timeout: Optional[float] = None) -> Any:
        if self._done:
            return self._result
        timeout = self._timeout if timeout is None else timeout
        for w in self._works:
            try:
                if timeout is None:
                    w.wait()
                else:
                    w.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as exc:
                if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                    raise CollectiveTimeoutError(
                        f"{self._what} did not complete within {timeout:g} s: at least one rank "
                        "never joined it") from exc
                if is_peer_loss(exc):
                    raise WorkerLostError(f"{self._what}: a rank left the job ({exc})") from exc
                raise
        self._works = []  # a completed work holds its tensors: let them go before the result is made
        self._result, self._done = self._finish(), True
        return self._result


#: The tensor allgather / reduce-scatter under their torch >= 2.13 names (the old ones warn there).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: dtypes gloo cannot move or reduce, and the dtype they travel as (exact for every op: the low
#: bits of an int32 sum, product, min or max are those of the int16 one).
_WIDER = {torch.int16: torch.int32, np.dtype(np.int16): np.dtype(np.int32)}


class _NarrowedHandle(Handle):
    """A collective that ran on a widened copy: cast the result back (and write it in place)."""

    def __init__(self, inner: Handle, original: Any, inplace: bool) -> None:
        self._inner, self._original, self._inplace = inner, original, inplace

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        result = self._inner.wait(timeout)
        if isinstance(self._original, np.ndarray):
            result = result.astype(self._original.dtype)
            if self._inplace:
                np.copyto(self._original, result)
                return self._original
            return result
        result = result.to(self._original.dtype)
        if self._inplace:
            self._original.copy_(result)
            return self._original
        return result


def _widened(tensor: Any) -> Optional[Any]:
    """A copy of ``tensor`` in a dtype gloo handles, or None when it needs none."""
    wider = _WIDER.get(getattr(tensor, "dtype", None))
    if wider is None:
        return None
    return tensor.astype(wider) if isinstance(tensor, np.ndarray) else tensor.to(wider)
