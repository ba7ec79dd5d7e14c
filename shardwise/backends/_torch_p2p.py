"""Point-to-point messages for the ``torch`` backend: ``isend``/``irecv`` with tags."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..core.comm import Handle
from ._torch_handles import _WorkHandle

__all__ = ["TorchPointToPoint"]


class TorchPointToPoint:
    """Mixin for :class:`~shardwise.backends.torch.TorchCommunicator` (uses its members and plumbing)."""

    # -- point to point -----------------------------------------------------------------------------
    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        t, _ = self._as_torch(tensor)
        work = dist.isend(t.contiguous(), dst=self._global(dest), group=self._group, tag=tag)
        return _WorkHandle("send", [work], lambda: None, self.timeout)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        t, _ = self._as_torch(tensor)
        buf = t if t.is_contiguous() else t.contiguous()
        work = dist.irecv(buf, src=self._global(source), group=self._group, tag=tag)

        def finish() -> Any:
            if buf is not t:
                t.copy_(buf)
            return tensor

        return _WorkHandle(f"recv from rank {source}", [work], finish, self.timeout)
