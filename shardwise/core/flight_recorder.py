"""A flight recorder of collectives: each communicator's last 32 calls, and the report of a stall.

Like torch's NCCL flight recorder, every collective a recorded communicator runs
leaves a :class:`CollectiveRecord` in a fixed ring of :data:`RING_SIZE` entries:
its sequence number on that communicator, the operation, the group, the tensor's
dtype and shape, its state (``started``, ``completed``, ``failed``) and its start
and end times. Recording costs one small object and two clock reads per call; the
ring never grows.

When a collective has not finished within the stall timeout, every rank prints
its ring (:meth:`FlightRecorder.format`) beside its Python stacks, and the ranks
that have not reached the stalled call's sequence number are named
(:func:`missing_ranks`, from each rank's :class:`Progress` on that group).

Pure Python: the communicator wrapper that fills the rings and the watchdog that
finds stalls and asks the other ranks for their progress live in
:mod:`shardwise.backends.recorded` and :mod:`shardwise.backends.stall_watch`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .errors import ConfigError

__all__ = ["RING_SIZE", "CollectiveRecord", "FlightRecorder", "Progress", "missing_ranks", "describe_stall"]

#: Entries each communicator's ring keeps (torch keeps ``TORCH_NCCL_TRACE_BUFFER_SIZE``).
RING_SIZE = 32
STARTED, COMPLETED, FAILED = "started", "completed", "failed"


class CollectiveRecord:
    """One collective as this rank saw it (mutable only through its recorder)."""

    __slots__ = ("seq", "op", "group", "name", "dtype", "shape", "state", "started", "ended")

    def __init__(self, seq: int, op: str, group: str, name: Optional[str], dtype: Optional[str],
                 shape: Optional[tuple], started: float) -> None:
        self.seq, self.op, self.group, self.name = seq, op, group, name
        self.dtype, self.shape = dtype, shape
        self.state: str = STARTED
        self.started: float = started
        self.ended: Optional[float] = None

    def label(self) -> str:
        """``allreduce #12 'grads' on world``."""
        named = f" '{self.name}'" if self.name else ""
        return f"{self.op} #{self.seq}{named} on {self.group}"

    def format(self, now: float) -> str:
        """One line of a dump: sequence, op, tensor, state and how long it took or has been waiting."""
        tensor = f" {self.dtype}{list(self.shape)}" if self.dtype is not None else ""
        if self.ended is None:
            timing = f"waiting {now - self.started:.3f} s"
        else:
            timing = f"took {self.ended - self.started:.6f} s"
        stamp = time.strftime("%H:%M:%S", time.localtime(self.started)) + f".{int(self.started % 1 * 1e3):03d}"
        return f"#{self.seq:<6d} {self.op:<17s}{tensor} {self.state:<9s} at {stamp} {timing}" + (
            f" name={self.name!r}" if self.name else "")


@dataclass(frozen=True)
class Progress:
    """How far one rank got on one group: its last started and last completed sequence numbers."""

    rank: int
    group_rank: int
    started: int
    completed: int


class FlightRecorder:
    """The ring of one communicator's last :data:`RING_SIZE` collectives.

    Sequence numbers count this communicator's collectives from 1; every member of the
    group numbers the same call alike, so a rank whose last started number is below a
    stalled call's never reached it. Thread-safe enough for one caller thread plus a
    watchdog that only reads (records are replaced whole; a torn read shows an older
    state, never a wrong one).
    """

    def __init__(self, group: str, capacity: int = RING_SIZE) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"a flight recorder keeps at least one entry, got capacity={capacity!r}")
        if not group:
            raise ConfigError("a flight recorder needs a group label (e.g. 'world')")
        self.group = group
        self.capacity = capacity
        self._ring: list[Optional[CollectiveRecord]] = [None] * capacity
        self._seq = 0
        self._completed = 0
        self._pending: dict[int, CollectiveRecord] = {}

    @property
    def last_started(self) -> int:
        """Sequence number of the last collective started here (0: none yet)."""
        return self._seq

    @property
    def last_completed(self) -> int:
        """Highest sequence number completed here (0: none yet)."""
        return self._completed

    def start(self, op: str, *, name: Optional[str] = None, dtype: Optional[str] = None,
              shape: Optional[Sequence[int]] = None) -> CollectiveRecord:
        """Record a collective as started and return its record (pass it to :meth:`end`)."""
        self._seq += 1
        record = CollectiveRecord(self._seq, op, self.group, name, dtype,
                                  None if shape is None else tuple(int(s) for s in shape), time.time())
        self._ring[(self._seq - 1) % self.capacity] = record
        self._pending[record.seq] = record
        return record

    def end(self, record: CollectiveRecord, ok: bool = True) -> None:
        """Mark ``record`` completed (or failed: it raised); idempotent."""
        if record.ended is not None:
            return
        record.ended = time.time()
        record.state = COMPLETED if ok else FAILED
        self._pending.pop(record.seq, None)
        self._completed = max(self._completed, record.seq)

    def records(self) -> list[CollectiveRecord]:
        """The ring's records, oldest first."""
        start = self._seq % self.capacity if self._seq >= self.capacity else 0
        ordered = self._ring[start:] + self._ring[:start]
        return [r for r in ordered if r is not None]

    def oldest_pending(self) -> Optional[CollectiveRecord]:
        """The started collective that has waited longest, or None."""
        pending = list(self._pending.values())
        return min(pending, key=lambda r: r.seq) if pending else None

    def progress(self, rank: int, group_rank: int) -> Progress:
        """This ring's :class:`Progress` for the rank that owns it."""
        return Progress(rank, group_rank, self._seq, self._completed)

    def format(self, now: Optional[float] = None) -> str:
        """The ring as text, a header line and one line per record, oldest first."""
        now = time.time() if now is None else now
        lines = [f"group {self.group}: last {min(self._seq, self.capacity)} of {self._seq} collectives "
                 f"(last completed #{self._completed})"]
        lines += ["  " + r.format(now) for r in self.records()]
        return "\n".join(lines)


def missing_ranks(seq: int, progress: Iterable[Progress]) -> list[int]:
    """Ranks (by their world rank) whose last started collective on the group is before ``seq``."""
    if seq < 1:
        raise ValueError(f"sequence numbers start at 1, got {seq}")
    return sorted(p.rank for p in progress if p.started < seq)


def describe_stall(record: CollectiveRecord, timeout: float, answers: Sequence[Progress], silent: Sequence[int],
                   waited: float) -> str:
    """The one-line verdict of a stall, naming the ranks that never reached ``record``."""
    missing = missing_ranks(record.seq, answers)
    reached = sorted(p.rank for p in answers if p.started >= record.seq)
    text = (f"{record.label()} stalled: not finished after {waited:.1f} s (stall timeout {timeout:g} s); "
            f"missing ranks {missing} have not reached it")
    if silent:
        text += f"; ranks {sorted(silent)} did not answer (dead, or holding the interpreter)"
    return text + f"; {len(reached)} rank(s) reached it"
