"""Point-to-point messages for the ``torch`` backend: ``isend``/``irecv`` with tags.

gloo moves CUDA tensors in its collectives (it stages them through pinned host memory
itself) but not in ``send``/``recv``: those hand the tensor's data pointer straight to
the TCP transport, which cannot read device memory. CUDA tensors on a gloo group (ranks
sharing a GPU, or a gloo group chosen on purpose) are therefore staged here: the send
travels from a pinned host copy, the receive lands in a pinned host buffer and is copied
to the device on the caller's stream when the handle is waited on.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ...core.comm import Handle
from .. import _device_staging as _staging
from ._handles import _WorkHandle

__all__ = ["TorchPointToPoint"]


class TorchPointToPoint:
    """Mixin for :class:`~shardwise.backends.torch.TorchCommunicator` (uses its members and plumbing)."""

    def _p2p_staged(self, t: Any) -> bool:
        """True when ``t`` is in device memory and this group sends it with gloo (host pointers only)."""
        return _staging.is_cuda(t) and self._engine_for(t) == "gloo"

    # -- point to point -----------------------------------------------------------------------------
    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        t, _ = self._as_torch(tensor)
        wire = _staging.to_host(t) if self._p2p_staged(t) else t.contiguous()
        work = dist.isend(wire, dst=self._global(dest), group=self._group, tag=tag)
        return _WorkHandle("send", [work], lambda: None, self.timeout)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        t, _ = self._as_torch(tensor)
        staged = self._p2p_staged(t)
        if staged:
            buf = _staging.pinned_empty(tuple(t.shape), t.dtype)
        else:
            buf = t if t.is_contiguous() else t.contiguous()
        work = dist.irecv(buf, src=self._global(source), group=self._group, tag=tag)

        def finish() -> Any:
            if staged:
                _staging.to_device(buf, t)
            elif buf is not t:
                t.copy_(buf)
            return tensor

        return _WorkHandle(f"recv from rank {source}", [work], finish, self.timeout)
