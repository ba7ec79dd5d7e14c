"""Which CUDA device this process uses: its node-local rank's, chosen before any engine group exists."""

from __future__ import annotations

import os
import sys
from typing import Optional

__all__ = ["BIND_ENV", "bind_local_device"]

#: Set to ``0`` to keep shardwise from choosing this process's CUDA device.
BIND_ENV = "SHARDWISE_BIND_DEVICE"


def bind_local_device(local_rank: int) -> Optional[int]:
    """Make ``cuda:local_rank`` (modulo the visible devices) this process's current CUDA device.

    Called by :func:`shardwise.init` under every launcher, before any NCCL group exists: ranks of
    one node then use different GPUs (more ranks than GPUs share them round-robin).
    Nothing happens when torch was not imported, CUDA is not available, or
    ``SHARDWISE_BIND_DEVICE=0``. Returns the device index bound, or ``None``.
    """
    if os.environ.get(BIND_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if count < 1:
        return None
    index = int(local_rank) % count
    torch.cuda.set_device(index)
    return index
