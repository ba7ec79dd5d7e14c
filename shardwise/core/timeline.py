"""A Chrome / Perfetto trace writer (``{"traceEvents": [...]}``), written atomically at the end.

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev; each rank is a
process (``pid``), with steps and collectives on separate tracks.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import tempfile
from typing import Any, Optional, Union

__all__ = ["Timeline", "TIMELINE_ENV"]

#: Environment variable naming the trace file a :class:`Timeline` writes by default.
TIMELINE_ENV = "SHARDWISE_TIMELINE"


class Timeline:
    """Chrome trace (``{"traceEvents": [...]}``) of complete events, written atomically on :meth:`close`.

    ``path`` defaults to ``$SHARDWISE_TIMELINE``; with neither the timeline is off.
    ``{rank}`` in the path is replaced by the rank; otherwise ranks other than 0
    write ``name.rank<r>.json`` beside it. ``pid`` is the rank. At most
    ``max_events`` events are kept; the number dropped is written as metadata.
    """

    def __init__(self, path: Union[str, os.PathLike[str], None] = None, *, rank: int = 0,
                 max_events: int = 1_000_000) -> None:
        raw = os.fspath(path) if path is not None else os.environ.get(TIMELINE_ENV, "")
        if raw and "{rank}" in raw:
            raw = raw.replace("{rank}", str(rank))
        elif raw and rank:
            stem, ext = os.path.splitext(raw)
            raw = f"{stem}.rank{rank}{ext or '.json'}"
        self.path: Optional[str] = raw or None
        self.rank = rank
        self._max, self._dropped = max_events, 0
        self._events: list[dict[str, Any]] = []
        self._closed = False
        if self.path:
            atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and a file will be written."""
        return self.path is not None and not self._closed

    def add(self, name: str, cat: str, start: float, duration: float, **args: Any) -> None:
        """Record an ``"X"`` event; ``start``/``duration`` in seconds, written in microseconds."""
        if not self.enabled:
            return
        if len(self._events) >= self._max:
            self._dropped += 1
            return
        self._events.append({"name": name, "cat": cat, "ph": "X", "ts": start * 1e6,
                             "dur": max(duration, 0.0) * 1e6, "pid": self.rank,
                             "tid": 1 if cat == "collective" else 0, "args": args})

    def close(self) -> None:
        """Write the trace (temporary file, then rename) and stop recording; idempotent."""
        if self._closed or self.path is None:
            self._closed = True
            return
        self._closed = True
        atexit.unregister(self.close)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "steps"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1,
                 "args": {"name": "collectives"}}]
        doc = {"traceEvents": meta + self._events, "displayTimeUnit": "ms",
               "otherData": {"dropped_events": self._dropped}}
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".timeline-", suffix=".json", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._events = []

    def __enter__(self) -> "Timeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
