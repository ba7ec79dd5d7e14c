"""The stall watchdog: a stalled collective makes every rank dump its stacks and flight recorder.

With a stall timeout set (``shardwise.init(stall_timeout=...)`` or
``SHARDWISE_STALL_TIMEOUT``), each rank runs one :class:`StallWatch` thread. It
sleeps, wakes every ``interval`` seconds (a quarter of the timeout, at most one
second) and looks at the oldest unfinished collective of every recorded
communicator (:mod:`shardwise.backends.recorded`). When one has waited longer than
the timeout, the rank

1. prints its Python stacks (every thread) and its flight recorders' last 32
   collectives to stderr, each line tagged ``[shardwise flight rank R/N]``;
2. asks every other rank, over a side channel, how far it got on that group.

The side channel is a duplicate of the world's MPI communicator used only by the
watch threads, with non-blocking sends and ``iprobe``: it never waits on a rank
that does not answer. A rank asked dumps its own stacks and rings (once per stall)
and answers with its :class:`~shardwise.core.flight_recorder.Progress`, so the
ranks that never reached the stalled call dump too, although they are not inside
a collective. After every rank has answered, or after ``answer_s`` seconds, the
lowest rank that reached the call prints the verdict naming the missing ranks
(and those that did not answer). The job itself is left alone: the collective
completes if the missing ranks come later.

Without a side channel (a backend that is not ``mpi``, or MPI below
``MPI_THREAD_MULTIPLE``) each stalled rank still dumps itself, and says that the
missing ranks cannot be named.

The watch is the one object the context owns for this (``Context.owned["stall_watch"]``);
there is no module-level state.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

from ..core.errors import ConfigError
from ..core.flight_recorder import CollectiveRecord, FlightRecorder, Progress, describe_stall

__all__ = ["StallWatch", "MPISideChannel", "format_stacks"]

#: Point-to-point tag of the side channel (on its own duplicate communicator).
SIDE_TAG = 32_002


def format_stacks(skip: Optional[int] = None) -> str:
    """Every thread's Python stack, most recent call last (``skip``: a thread id to leave out)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        parts.append(f"thread {names.get(ident, '?')} (id {ident}):\n"
                     + "".join(traceback.format_stack(frame)).rstrip("\n"))
    return "\n".join(parts)


class MPISideChannel:
    """Small pickled messages between watch threads on a duplicate of an mpi4py communicator."""

    def __init__(self, mpi_comm: Any) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = mpi_comm.Dup()  # collective; made on the main thread at init
        self._sends: list[Any] = []

    @classmethod
    def for_world(cls, world: Any) -> Optional["MPISideChannel"]:
        """A channel over ``world``'s ``mpi_comm``, or None where MPI cannot take a second thread (collective)."""
        mpi_comm = getattr(world, "mpi_comm", None)
        if mpi_comm is None:
            return None
        from mpi4py import MPI

        ok = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if not all(mpi_comm.allgather(ok)):
            return None
        return cls(mpi_comm)

    def post(self, dest: int, message: Any) -> None:
        """Send without waiting; finished sends are dropped at the next post."""
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends.append(self.comm.isend(message, dest=dest, tag=SIDE_TAG))

    def poll(self) -> list[tuple[int, Any]]:
        """Every message that has arrived, as (source, message); never waits for one."""
        got = []
        status = self._mpi.Status()
        while self.comm.iprobe(source=self._mpi.ANY_SOURCE, tag=SIDE_TAG, status=status):
            source = status.Get_source()
            got.append((source, self.comm.recv(source=source, tag=SIDE_TAG)))
        return got


class _Stall:
    """A stall this rank found: the record, and the answers being collected."""

    def __init__(self, record: CollectiveRecord, deadline: float) -> None:
        self.record, self.deadline = record, deadline
        self.answers: dict[int, Progress] = {}


class StallWatch:
    """Watches every registered flight recorder of this rank for a collective older than ``timeout``."""

    def __init__(self, timeout: float, rank: int, size: int, channel: Optional[MPISideChannel] = None, *,
                 interval: Optional[float] = None, answer_s: Optional[float] = None,
                 out: Optional[Callable[[str], None]] = None) -> None:
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"the stall timeout must be positive seconds, got {timeout!r}")
        if not 0 <= rank < size:
            raise ConfigError(f"rank {rank} is outside a job of size {size}")
        self.timeout = float(timeout)
        self.rank, self.size, self.channel = rank, size, channel
        self.interval = min(1.0, self.timeout / 4) if interval is None else float(interval)
        self.answer_s = min(5.0, self.timeout) if answer_s is None else float(answer_s)
        self._out = out or _stderr
        self._recorders: dict[int, tuple[FlightRecorder, int]] = {}
        self._dumped: set[tuple[str, int]] = set()
        self._asked: set[tuple[str, int]] = set()
        self._stalls: dict[tuple[str, int], _Stall] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_world(cls, world: Any, timeout: float) -> "StallWatch":
        """A started watch for ``world``'s job, with an MPI side channel where one can be had (collective)."""
        watch = cls(timeout, world.rank, world.size, MPISideChannel.for_world(world))
        watch.start()
        return watch

    # -- recorders ---------------------------------------------------------------------------
    def register(self, recorder: FlightRecorder, group_rank: int) -> None:
        """Watch ``recorder`` (this rank is ``group_rank`` in its group)."""
        with self._lock:
            self._recorders[id(recorder)] = (recorder, group_rank)

    def unregister(self, recorder: FlightRecorder) -> None:
        """Stop watching ``recorder`` (its communicator was freed)."""
        with self._lock:
            self._recorders.pop(id(recorder), None)

    def recorders(self) -> list[FlightRecorder]:
        """The rings watched, in registration order."""
        with self._lock:
            return [r for r, _ in self._recorders.values()]

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the watch thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="shardwise-stall-watch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread (idempotent); a stall report in progress is dropped."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval if not self._stalls else min(self.interval, 0.05)):
            try:
                self.poll()
            except Exception as exc:  # the watchdog must never take the job down
                self._out(self._tag(f"stall watch error: {exc!r}"))

    def poll(self, now: Optional[float] = None) -> None:
        """One look: answer questions, find new stalls, finish reports whose answers are in."""
        now = time.time() if now is None else now
        if self.channel is not None:
            for source, message in self.channel.poll():
                self._receive(source, message)
        for recorder in self.recorders():
            record = recorder.oldest_pending()
            if record is None or now - record.started < self.timeout:
                continue
            key = (record.group, record.seq)
            if key in self._asked:
                continue
            self._asked.add(key)  # a rank asked about it before it saw the stall itself asks too
            self._dump(key, f"{record.label()} has waited {now - record.started:.1f} s "
                            f"(stall timeout {self.timeout:g} s)")
            if self.channel is None:
                self._out(self._tag(f"{record.label()} stalled; the missing ranks cannot be named without "
                                    "an MPI side channel (mpi backend at MPI_THREAD_MULTIPLE)"))
                continue
            stall = self._stalls[key] = _Stall(record, now + self.answer_s)
            stall.answers[self.rank] = self._progress(record.group)
            for dest in range(self.size):
                if dest != self.rank:
                    self.channel.post(dest, ("ask", record.group, record.seq, self.rank))
        for key, stall in list(self._stalls.items()):
            if len(stall.answers) == self.size or now >= stall.deadline:
                del self._stalls[key]
                self._verdict(stall, now)

    # -- messages ------------------------------------------------------------------------------
    def _progress(self, group: str) -> Optional[Progress]:
        with self._lock:
            watched = list(self._recorders.values())
        for recorder, group_rank in watched:
            if recorder.group == group:
                return recorder.progress(self.rank, group_rank)
        return None  # not a member of that group

    def _receive(self, source: int, message: Any) -> None:
        kind, group, seq = message[0], message[1], message[2]
        if kind == "ask":
            asker = message[3]
            self._dump((group, seq), f"rank {asker} reports {group} collective #{seq} stalled")
            self.channel.post(source, ("progress", group, seq, self._progress(group)))
        elif kind == "progress":
            stall = self._stalls.get((group, seq))
            if stall is not None:
                stall.answers[source] = message[3]

    def _verdict(self, stall: _Stall, now: float) -> None:
        members = [p for p in stall.answers.values() if p is not None]
        reached = sorted(p.rank for p in members if p.started >= stall.record.seq)
        if reached and reached[0] != self.rank:
            return  # the lowest rank that reached the call speaks for all of them
        silent = [r for r in range(self.size) if r not in stall.answers]
        self._out(self._tag(describe_stall(stall.record, self.timeout, members, silent,
                                           now - stall.record.started)))

    # -- output ----------------------------------------------------------------------------------
    def _tag(self, text: str) -> str:
        prefix = f"[shardwise flight rank {self.rank}/{self.size}] "
        return "".join(prefix + line + "\n" for line in text.splitlines())

    def _dump(self, key: tuple[str, int], why: str) -> None:
        """Print this rank's stacks and rings, once per stalled collective."""
        if key in self._dumped:
            return
        self._dumped.add(key)
        now = time.time()
        rings = "\n".join(r.format(now) for r in self.recorders())
        clock = time.strftime("%H:%M:%S", time.localtime(now))
        text = (f"===== stall dump at {now:.3f} ({clock}): {why} =====\n"
                f"Python stacks:\n{format_stacks(skip=self._thread.ident if self._thread is not None else None)}\n"
                f"flight recorder:\n{rings}\n===== end of stall dump =====")
        self._out(self._tag(text))


def _stderr(text: str) -> None:
    """Write ``text`` to stderr in one call, so that lines of different ranks do not interleave mid-line."""
    data = text.encode()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    sys.stderr.flush()
    while data:
        data = data[os.write(fd, data):]

