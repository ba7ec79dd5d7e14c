"""Ports and addresses that engines announce to their peers when they wire up."""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "host_address"]


def free_port() -> int:
    """A TCP port free on this host right now (another process may still take it before it is used)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_address() -> str:
    """This host's address for peers: ``SHARDWISE_WORKER_ADDR``, else its resolved name, else the name."""
    override = os.environ.get("SHARDWISE_WORKER_ADDR")
    if override:
        return override
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()
