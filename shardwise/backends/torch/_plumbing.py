"""Plumbing for the ``torch`` backend: numpy/torch conversion, rank order, finishing work.

A mixin for :class:`~shardwise.backends.torch.TorchCommunicator` (it uses the
communicator's members): numpy arrays travel as ``torch.from_numpy`` views and go back
as numpy, in-place results are written back, our rank order is mapped to torch's
group-rank order (see ``order`` in the communicator), and work objects become handles.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ...core.comm import CompletedHandle, Handle
from ._handles import _WorkHandle
from .._rank_order import to_engine_order, to_our_order

__all__ = ["TorchPlumbing"]


class TorchPlumbing:
    """Mixin for :class:`~shardwise.backends.torch.TorchCommunicator` (uses its members)."""

    # -- plumbing ----------------------------------------------------------------------------
    @staticmethod
    def _as_torch(x: Any) -> tuple[Any, bool]:
        if isinstance(x, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(x)), True
        if isinstance(x, torch.Tensor):
            return x.detach(), False
        raise TypeError(f"unsupported tensor type {type(x).__name__}; pass a numpy array or a torch tensor")

    @staticmethod
    def _back(t: Any, was_numpy: bool) -> Any:
        return t.numpy() if was_numpy else t

    @staticmethod
    def _write_back(original: Any, original_t: Any, result: Any, was_numpy: bool) -> Any:
        """Publish an in-place result into ``original`` if the engine worked on a copy."""
        if was_numpy:
            res = result.numpy()
            if not np.shares_memory(original, res):
                np.copyto(original, res)
        elif result is not original_t:
            original_t.copy_(result)
        return original

    def _engine_for(self, t: Any) -> str:
        """The engine that moves ``t`` in this group: ``"gloo"``, ``"nccl"``, ... (``""``: none).

        A group made with ``"cpu:gloo,cuda:nccl"`` (the torch backend with CUDA) names one per device type.
        """
        name = str(dist.get_backend(self._group))
        if ":" not in name:
            return name
        return dict(part.split(":", 1) for part in name.split(",")).get(t.device.type, "")

    def _gloo_on_host(self, t: Any) -> bool:
        """True when ``t`` lives in host memory and the group runs it on gloo (our own algorithms apply)."""
        return t.device.type == "cpu" and self._engine_for(t) == "gloo"

    def _global(self, peer: int) -> int:
        if not 0 <= peer < self._size:
            raise ValueError(f"rank {peer} is out of range for a group of size {self._size}")
        peer = self._order[peer] if self._order else peer
        return dist.get_global_rank(self._group, peer) if self._group is not dist.group.WORLD else peer

    def _by_group_rank(self, blocks: list) -> list:
        """Reorder per-rank blocks from our rank order to torch's group-rank order."""
        return to_engine_order(blocks, self._order)

    def _by_our_rank(self, blocks: list) -> list:
        """Reorder per-rank blocks from torch's group-rank order to our rank order."""
        return to_our_order(blocks, self._order)

    def _done(self, what: str, works: list, finish: Callable[[], Any], blocking: bool) -> Handle:
        handle = _WorkHandle(what, works, finish, self.timeout)
        return CompletedHandle(handle.wait()) if blocking else handle
