"""Host staging of CUDA tensors for the engines that move host memory (``mpi``, ``local``).

MPI reads and writes host memory, so a CUDA tensor is copied to the host before a collective
and its result copied back. The copies use page-locked (pinned) buffers from torch's caching
host allocator, so they run at full bus speed, need no allocation once the cache is warm,
and are not staged through the driver's own bounce buffer as ``tensor.cpu()`` is. Both run
``non_blocking`` on the caller's current stream, which orders them after the kernels that
produced the tensor and before the kernels that read the result:

* device to host: the host waits on one event recorded right after the copy (not on the
  whole device), since the engine reads the bytes next;
* host to device: queued and not waited for; the allocator keeps the pinned buffer until the
  copy has run (torch records the copy's stream on it), so it may be dropped at once.

Collectives that run on the ``mpi`` backend's worker thread see the issuing thread's stream:
:func:`caller_stream` captures it at submission.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, ContextManager

__all__ = ["is_cuda", "to_host", "pinned_empty", "to_device", "new_on_device", "caller_stream"]


def is_cuda(t: Any) -> bool:
    """True for a torch tensor on a CUDA device."""
    return t.device.type == "cuda"


def pinned_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised pinned host tensor."""
    import torch

    return torch.empty(shape, dtype=dtype, pin_memory=True)


def to_host(t: Any) -> Any:
    """A contiguous pinned host copy of CUDA tensor ``t``, complete when this returns."""
    import torch

    host = pinned_empty(tuple(t.shape), t.dtype)
    host.copy_(t.detach(), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))
    copied.synchronize()
    return host


def to_device(host: Any, dst: Any) -> None:
    """Queue the copy of pinned ``host`` into CUDA tensor ``dst`` on the current stream."""
    dst.copy_(host, non_blocking=True)


def new_on_device(host: Any, device: Any) -> Any:
    """A CUDA tensor filled from pinned ``host`` by a copy queued on the current stream."""
    return host.to(device, non_blocking=True)


def caller_stream() -> Callable[[], ContextManager[Any]]:
    """A context factory that makes the calling thread's current CUDA stream current again.

    Used to run a collective on another thread as if it ran here. A no-op when torch is not
    imported or CUDA was never initialised (numpy users, CPU tensors).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return contextlib.nullcontext
    stream = torch.cuda.current_stream()
    return lambda: torch.cuda.stream(stream)
