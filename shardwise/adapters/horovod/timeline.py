"""Horovod's timeline (``hvd.start_timeline``): a Chrome trace of each named collective's phases.

Each request is a trace process named after it (``allreduce.loss``) with a
``NEGOTIATE_<KIND>`` span (submitted until every rank had it) followed by a
``<KIND>`` span (the data movement); ``mark_cycles`` adds a ``CYCLE_START``
instant per coordinator round. Only rank 0 writes, as in Horovod; the file is
written atomically by :meth:`HorovodTimeline.stop`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from shardwise.checkpoint.atomic import atomic_write_bytes

__all__ = ["HorovodTimeline"]


class HorovodTimeline:
    """An open timeline; thread-safe, since the coordinator threads record into it."""

    def __init__(self, path: str, *, mark_cycles: bool = False, rank: int = 0) -> None:
        self.path, self.mark_cycles, self.rank = os.fspath(path), mark_cycles, rank
        self._lock = threading.Lock()
        self._start_us = time.time_ns() // 1000
        self._events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "shardwise timeline",
                                                                  "start_time_since_epoch_in_micros":
                                                                  self._start_us}}]
        self._pids: dict[str, int] = {}
        self._open: dict[str, str] = {}

    def _now(self) -> int:
        return time.time_ns() // 1000 - self._start_us

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        return pid

    def begin(self, name: str, phase: str) -> None:
        """Open span ``phase`` on the track of request ``name`` (closing any open one)."""
        with self._lock:
            pid = self._pid(name)
            if name in self._open:
                self._events.append({"ph": "E", "pid": pid, "tid": 1, "ts": self._now()})
            self._open[name] = phase
            self._events.append({"name": phase, "ph": "B", "pid": pid, "tid": 1, "ts": self._now()})

    def end(self, name: str) -> None:
        """Close the open span of request ``name``."""
        with self._lock:
            if self._open.pop(name, None) is not None:
                self._events.append({"ph": "E", "pid": self._pid(name), "tid": 1, "ts": self._now()})

    def cycle(self) -> None:
        """Mark the start of a coordinator round (only with ``mark_cycles``)."""
        if self.mark_cycles:
            with self._lock:
                self._events.append({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                                     "ts": self._now()})

    def stop(self) -> None:
        """Write the trace (rank 0 only)."""
        if self.rank != 0:
            return
        with self._lock:
            data = json.dumps(self._events, indent=0).encode()
        atomic_write_bytes(self.path, data)
