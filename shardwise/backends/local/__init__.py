"""The ``local`` backend: one process, every collective an identity (or a copy)."""

from __future__ import annotations

from typing import Any, Optional

from ...core.launch_env import LaunchInfo
from .communicator import LocalCommunicator

__all__ = ["LocalCommunicator", "init"]


def init(launch: LaunchInfo, timeout: Optional[float] = None) -> dict[str, Any]:
    """Nothing to start for one process; returns what the context owns (nothing)."""
    return {}
