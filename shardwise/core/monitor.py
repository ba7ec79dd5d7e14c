"""Framework-neutral accounting of communication vs. compute, and a Chrome/Perfetto trace writer.

A collective occupies ``[start, end]``; the caller waits in it during
``[wait_start, end]`` (the whole interval for a blocking call, only the tail for an
async one waited on later). Per step, *exposed* communication is the time covered
by waits, *overlapped* the rest of the time covered by collectives (hidden behind
compute), and *compute* the step time not spent waiting. Overlapping intervals are
merged, so concurrent collectives are not counted twice. Times are seconds from
the monitor's clock (``time.perf_counter`` unless given).

Use::

    mon = CommMonitor(rank=comm.rank)            # SHARDWISE_TIMELINE=trace.json to record
    with mon.step():
        with mon.collective("allreduce.grads", nbytes):
            comm.allreduce(grads)
        h = mon.track("allgather.params", nbytes, comm.allgather(x, async_op=True))
        ...; h.wait()
    mon.summary(); mon.close()
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

from .comm import Handle
from .errors import ConfigError
from .timeline import TIMELINE_ENV, Timeline

__all__ = ["CollectiveRecord", "StepRecord", "CommMonitor", "Timeline", "scaling_efficiency",
           "TIMELINE_ENV"]
_MAX_PENDING = 100_000  # collectives kept while waiting for a step to claim them


@dataclass(frozen=True, kw_only=True)
class CollectiveRecord:
    """One collective as observed by the calling rank."""

    name: str
    """What was communicated, e.g. ``"allreduce.grads"``."""
    nbytes: int
    """Bytes of the local buffer."""
    start: float
    """When the collective was issued."""
    end: float
    """When it was observed complete."""
    wait_start: float
    """When the caller started blocking on it (``start`` for a blocking call)."""


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """Time accounting of one training step."""

    index: int
    """Step number, from 0, warm-up steps included."""
    start: float
    """Step start."""
    end: float
    """Step end."""
    comm_time: float
    """Time covered by collectives."""
    exposed_comm_time: float
    """Time the step waited in collectives."""
    nbytes: int
    """Bytes of the step's collectives."""

    @property
    def step_time(self) -> float:
        """``end - start``."""
        return self.end - self.start

    @property
    def overlapped_comm_time(self) -> float:
        """Communication hidden behind compute."""
        return self.comm_time - self.exposed_comm_time

    @property
    def compute_time(self) -> float:
        """Step time not spent waiting in collectives."""
        return self.step_time - self.exposed_comm_time

    @property
    def fraction(self) -> float:
        """Exposed communication as a share of the step."""
        return self.exposed_comm_time / self.step_time if self.step_time > 0 else 0.0


def _covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi]``."""
    total, reach = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


class _TrackedHandle(Handle):
    """A handle whose :meth:`wait` records the collective in a monitor."""

    def __init__(self, monitor: "CommMonitor", name: str, nbytes: int, handle: Handle) -> None:
        self._monitor, self._name, self._nbytes, self._inner = monitor, name, nbytes, handle
        self._start, self._recorded = monitor.now(), False

    def wait(self, timeout: Optional[float] = None) -> Any:
        begin = self._monitor.now()
        result = self._inner.wait(timeout)
        if not self._recorded:
            self._recorded = True
            self._monitor.record_collective(self._name, self._nbytes, self._start, self._monitor.now(),
                                            wait_start=begin)
        return result

    def done(self) -> bool:
        return self._inner.done()


class CommMonitor:
    """Per-step compute vs. communication accounting, with a warning when communication dominates.

    ``warn_threshold``: warn (once) when the exposed fraction over the measured
    steps exceeds it. ``warmup_steps`` first steps are recorded but not measured.
    ``timeline``: a :class:`Timeline`, a path, or ``None`` for ``$SHARDWISE_TIMELINE``.
    """

    def __init__(self, *, rank: int = 0, warn_threshold: Optional[float] = 0.2, warmup_steps: int = 1,
                 timeline: Union[Timeline, str, os.PathLike[str], None] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if warn_threshold is not None and not 0 <= warn_threshold <= 1:
            raise ConfigError(f"warn_threshold must be in [0, 1] or None, got {warn_threshold!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.rank, self.warn_threshold, self.warmup_steps = rank, warn_threshold, warmup_steps
        self.timeline = timeline if isinstance(timeline, Timeline) else Timeline(timeline, rank=rank)
        self._clock = clock
        self._origin = clock()
        self._pending: list[CollectiveRecord] = []
        self._steps: list[StepRecord] = []
        self._by_name: dict[str, list[float]] = {}  # name -> [count, bytes, seconds, exposed seconds]
        self._open_step: Optional[float] = None
        self._warned = False

    def now(self) -> float:
        """Seconds since the monitor was created."""
        return self._clock() - self._origin

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time one training step (not nestable)."""
        if self._open_step is not None:
            raise ConfigError("CommMonitor.step() is already open; steps cannot nest")
        self._open_step = start = self.now()
        try:
            yield
        finally:
            self._open_step = None
            self._record_step(start, self.now(), stacklevel=5)

    @contextlib.contextmanager
    def collective(self, name: str, nbytes: int) -> Iterator[None]:
        """Time a blocking collective (all of it is exposed)."""
        start = self.now()
        try:
            yield
        finally:
            self.record_collective(name, nbytes, start, self.now())

    def track(self, name: str, nbytes: int, handle: Handle) -> Handle:
        """Wrap an async collective's handle: issued now, exposed only while :meth:`Handle.wait` blocks."""
        return _TrackedHandle(self, name, nbytes, handle)

    def record_collective(self, name: str, nbytes: int, start: float, end: float, *,
                          wait_start: Optional[float] = None) -> CollectiveRecord:
        """Record a collective from explicit times (``wait_start`` defaults to ``start``: blocking)."""
        if not end >= start or isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigError(f"collective {name!r}: need end >= start and integer nbytes >= 0, "
                              f"got start={start}, end={end}, nbytes={nbytes!r}")
        wait = start if wait_start is None else min(max(wait_start, start), end)
        record = CollectiveRecord(name=name, nbytes=nbytes, start=start, end=end, wait_start=wait)
        self._pending.append(record)
        if len(self._pending) > _MAX_PENDING:  # no steps recorded: keep the newest half
            del self._pending[:_MAX_PENDING // 2]
        stats = self._by_name.setdefault(name, [0, 0, 0.0, 0.0])
        stats[0] += 1
        stats[1] += nbytes
        stats[2] += end - start
        stats[3] += end - wait
        self.timeline.add(name, "collective", start, end - start, bytes=nbytes, exposed_us=(end - wait) * 1e6)
        return record

    def record_step(self, start: float, end: float) -> StepRecord:
        """Close a step from explicit times; it takes the collectives recorded since the last step."""
        return self._record_step(start, end, stacklevel=4)

    def _record_step(self, start: float, end: float, stacklevel: int) -> StepRecord:
        if not end >= start:
            raise ConfigError(f"step end {end} is before its start {start}")
        mine = [c for c in self._pending if c.end > start and c.start < end]
        self._pending = [c for c in self._pending if c.end > end]  # still running: next step's
        record = StepRecord(index=len(self._steps), start=start, end=end,
                            comm_time=_covered([(c.start, c.end) for c in mine], start, end),
                            exposed_comm_time=_covered([(c.wait_start, c.end) for c in mine], start, end),
                            nbytes=sum(c.nbytes for c in mine))
        self._steps.append(record)
        self.timeline.add(f"step {record.index}", "step", start, end - start,
                          comm_fraction=round(record.fraction, 4))
        self._maybe_warn(stacklevel)
        return record

    @property
    def steps(self) -> tuple[StepRecord, ...]:
        """Every step recorded, warm-up included."""
        return tuple(self._steps)

    @property
    def measured_steps(self) -> tuple[StepRecord, ...]:
        """Steps after the warm-up."""
        return tuple(self._steps[self.warmup_steps:])

    @property
    def fraction(self) -> float:
        """Exposed communication over step time, summed over the measured steps (0 if none)."""
        steps = self.measured_steps
        total = sum(s.step_time for s in steps)
        return sum(s.exposed_comm_time for s in steps) / total if total > 0 else 0.0

    def _maybe_warn(self, stacklevel: int) -> None:
        if self._warned or self.warn_threshold is None or not self.measured_steps:
            return
        if self.fraction > self.warn_threshold:
            self._warned = True
            warnings.warn(f"rank {self.rank}: communication is {self.fraction:.0%} of step time "
                          f"(threshold {self.warn_threshold:.0%}); consider a larger micro-batch, "
                          f"gradient compression or overlapping communication", RuntimeWarning,
                          stacklevel=stacklevel)

    def summary(self) -> dict[str, Any]:
        """Totals over the measured steps plus per-collective counts, bytes and seconds (all steps)."""
        steps = self.measured_steps
        total = sum(s.step_time for s in steps)
        comm = sum(s.comm_time for s in steps)
        exposed = sum(s.exposed_comm_time for s in steps)
        nbytes = sum(s.nbytes for s in steps)
        warmup = min(self.warmup_steps, len(self._steps))
        return {"rank": self.rank, "steps": len(steps), "warmup_steps": warmup,
                "step_time_total": total, "step_time_mean": total / len(steps) if steps else 0.0,
                "compute_time": total - exposed, "comm_time": comm, "exposed_comm_time": exposed,
                "overlapped_comm_time": comm - exposed, "fraction": self.fraction, "bytes": nbytes,
                "bandwidth": nbytes / comm if comm > 0 else 0.0,
                "collectives": {name: {"count": int(c), "bytes": int(b), "time": t, "exposed_time": e}
                                for name, (c, b, t, e) in sorted(self._by_name.items())}}

    def close(self) -> None:
        """Write the timeline, if any."""
        self.timeline.close()

    def __enter__(self) -> "CommMonitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scaling_efficiency(samples_per_s_1: float, samples_per_s_n: float, n: int) -> float:
    """Weak-scaling efficiency: throughput on ``n`` devices over ``n`` times that on one."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n must be an integer >= 1, got {n!r}")
    for name, value in (("samples_per_s_1", samples_per_s_1), ("samples_per_s_n", samples_per_s_n)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                or value <= 0:
            raise ConfigError(f"{name} must be a positive number, got {value!r}")
    return samples_per_s_n / (n * samples_per_s_1)
