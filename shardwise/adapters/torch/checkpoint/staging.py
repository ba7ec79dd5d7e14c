"""Host staging for background checkpoint saves: copies of this rank's tensors that training does not touch.

:class:`HostStaging` holds one flat host buffer per tensor a rank saves, made on the first save and
reused by every later save with the same tensors (names, dtypes, sizes), so that a save costs one
copy and no allocation. Buffers of tensors on a CUDA device are pinned (page-locked), so the copy
runs at full bandwidth; the copies are enqueued without blocking and synchronized once at the end,
before the caller returns to training (which may then change the originals at once).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["HostStaging"]


class HostStaging:
    """Reusable host copies of a list of named tensors (see the module docstring).

    Not thread-safe, and a staged buffer must not be restaged while a background write reads it:
    :class:`~shardwise.checkpoint.async_save.BackgroundSaver` waits for the save in flight first.
    """

    def __init__(self) -> None:
        self._layout: list[tuple[str, torch.dtype, int, bool]] = []
        self._buffers: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def stage(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Copy each ``(name, tensor)`` into its host buffer; return ``(name, 1-D host copy)`` pairs.

        The buffers are reallocated only when the names, dtypes, sizes or devices differ from the
        previous call's. Returns once every copy is complete.
        """
        flat = [(name, t.detach().reshape(-1)) for name, t in tensors]
        layout = [(name, t.dtype, t.numel(), t.device.type == "cuda") for name, t in flat]
        if layout != self._layout:
            self._buffers = []  # release the old buffers before making the new ones
            pin = torch.cuda.is_available()
            self._buffers = [torch.empty(n, dtype=dtype, pin_memory=cuda and pin) for _, dtype, n, cuda in layout]
            self._layout = layout
        on_device = False
        for (name, src), buf in zip(flat, self._buffers):
            cuda = src.device.type == "cuda"
            on_device = on_device or cuda
            buf.copy_(src, non_blocking=cuda)
        if on_device:
            torch.cuda.synchronize()  # the copies are complete before training may change the originals
        return [(name, buf) for (name, _), buf in zip(flat, self._buffers)]

    def release(self) -> None:
        """Drop the buffers (the next :meth:`stage` makes them again)."""
        self._layout, self._buffers = [], []
