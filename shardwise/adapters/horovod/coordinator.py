"""The background coordinator behind Horovod's collective API (``hvd.allreduce_async`` and friends).

Each process set has one :class:`Coordinator`: a thread that owns a dedicated
communicator (a duplicate of the set's, so it never interleaves with collectives
the main thread runs directly, such as the gradient synchroniser's). Callers
:meth:`Coordinator.submit` named requests and get a :class:`Future`; the thread
announces new requests to the other ranks once per round (one ``allgather_object``),
folds every rank's announcements into a :class:`~shardwise.core.negotiation.Negotiator`
and runs what is ready, in the same order on every rank. A request that disagrees
across ranks fails on every rank with the same message, and the ranks stay in step.
That is how Horovod behaves: matching by name, errors instead of hangs, ``join()``.

A rank with nothing to announce takes no part in rounds; the others wait in the
round's allgather for it, as they would wait in the collective itself.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from shardwise.core.comm import Communicator, ReduceOp
from shardwise.core.errors import CollectiveMismatchError, ConfigError, ShardwiseError
from shardwise.core.negotiation import Announcement, Negotiator, RequestMeta, Response, ResponseCache

from .bit_exchange import tree_min
from .timeline import HorovodTimeline

__all__ = ["Coordinator", "Future", "CoordinatorShutdownError", "DuplicateNameError", "NegotiationStats"]

log = logging.getLogger("shardwise.coordinator")

#: Seconds a request may wait for other ranks before a stall warning names them (Horovod's default).
STALL_WARNING_S = float(os.environ.get("SHARDWISE_STALL_CHECK_TIME_SECONDS",
                                       os.environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", "60")))
#: Requests the response cache keeps (Horovod's variable and default; 0: every round exchanges whole announcements).
CACHE_CAPACITY_ENV = ("SHARDWISE_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY")
#: Longest pause between rounds while requests wait for other ranks.
_MAX_BACKOFF_S = 0.005


@dataclass
class NegotiationStats:
    """What this rank's coordinator spent on negotiation (not on the requests' own data movement).

    ``messages`` and ``bytes_*`` count this rank's negotiation traffic: every round's
    agreement over the response-cache bits (:func:`~.bit_exchange.tree_min`: its messages
    sent and bytes each way), and for a full round of announcements (an ``allgather`` of
    pickled announcements, when a request is new to the cache) one message out carrying
    its own announcement and the bytes of every rank's coming in.
    """

    rounds: int = 0
    #: Rounds that exchanged whole announcements (an allgather of every rank's requests).
    full_rounds: int = 0
    requests: int = 0
    messages: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def per_request(self) -> dict[str, float]:
        """Rounds, messages and bytes per negotiated request."""
        n = max(self.requests, 1)
        return {"rounds": self.rounds / n, "messages": self.messages / n, "bytes_sent": self.bytes_sent / n,
                "bytes_received": self.bytes_received / n}


class CoordinatorShutdownError(ShardwiseError, RuntimeError):
    """A request could not complete because the coordinator has been shut down."""


class DuplicateNameError(ShardwiseError, ValueError):
    """A request was submitted under a name that is still in flight on this rank."""


class Future:
    """The outcome of one submitted request: :meth:`wait` returns the result or raises the error."""

    def __init__(self, on_collect: Callable[[], None] = lambda: None) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._on_collect: Optional[Callable[[], None]] = on_collect

    def set_result(self, result: Any) -> None:
        """Complete with ``result``."""
        self._result = result
        self._event.set()

    def set_error(self, error: BaseException) -> None:
        """Complete with ``error``."""
        self._error = error
        self._event.set()

    def done(self) -> bool:
        """True once the request completed (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done; return the result or raise the error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"request not complete after {timeout} s")
        if self._on_collect is not None:
            self._on_collect, collect = None, self._on_collect
            collect()
        if self._error is not None:
            raise self._error
        return self._result


#: ``execute(comm, response)`` runs the request's data movement and returns its result.
Executor = Callable[[Communicator, Response], Any]


class _Request:
    __slots__ = ("meta", "execute", "future", "submitted")

    def __init__(self, meta: RequestMeta, execute: Executor, future: Future) -> None:
        self.meta, self.execute, self.future = meta, execute, future
        self.submitted = time.monotonic()


def joined_contribution(comm: Communicator, response: Response) -> None:
    """The part a joined rank plays in ``response``: zeros in place of its allreduce tensors.

    Adapters' allreduce executors reduce all tensors of a request as one flat buffer
    of their common dtype; a joined rank sends zeros of the same length.
    """
    meta = response.meta()
    if meta.kind == "barrier":
        comm.barrier()
        return
    numel = sum(int(np.prod(s, dtype=np.int64)) for s in meta.shapes)
    comm.allreduce(_zeros(meta.dtypes[0], numel), ReduceOp.parse(meta.op))


def _zeros(dtype: str, numel: int) -> Any:
    if dtype == "bfloat16":
        import torch  # numpy has no bfloat16; only a torch caller can have sent one

        return torch.zeros(numel, dtype=torch.bfloat16)
    return np.zeros(numel, dtype=np.dtype(dtype))


def _cache_capacity() -> int:
    for variable in CACHE_CAPACITY_ENV:
        raw = os.environ.get(variable, "").strip()
        if raw:
            if not raw.isdigit():
                raise ConfigError(f"{variable}={raw!r} must be a number of requests >= 0")
            return int(raw)
    return 1024


class Coordinator:
    """Negotiates and runs the named requests of one process set on a dedicated communicator."""

    def __init__(self, comm: Communicator, *, label: str = "global",
                 timeline: Optional[Callable[[], Optional[HorovodTimeline]]] = None) -> None:
        self.comm = comm
        self.label = label
        self._timeline = timeline or (lambda: None)
        self._negotiator = Negotiator(comm.size)
        self._cache = ResponseCache(comm.rank, _cache_capacity())
        #: This rank's pending requests announced by their response-cache bit: bit -> name.
        self._hits: dict[int, str] = {}
        self._cond = threading.Condition()
        self._new: list[_Request] = []
        self._pending: dict[str, _Request] = {}
        self._in_flight: set[str] = set()
        self._join: Optional[Future] = None
        self._join_announced = False
        self._stopping = False
        self._stopped = False
        self._counters: dict[str, int] = {}
        self._thread: Optional[threading.Thread] = None
        self._warned: set[str] = set()
        #: Negotiation traffic of this rank so far (see :class:`NegotiationStats`).
        self.stats = NegotiationStats()

    # -- caller side ----------------------------------------------------------------------------
    def auto_name(self, kind: str) -> str:
        """The name Horovod gives an unnamed request: ``<kind>.noname.<n>`` (same order on every rank)."""
        with self._cond:
            self._counters[kind] = self._counters.get(kind, 0) + 1
            return f"{kind}.noname.{self._counters[kind]}"

    def _catch_up(self, name: str) -> None:
        """A joined rank skips the automatic names the others used meanwhile, to stay in step."""
        kind, _, number = name.partition(".noname.")
        if number.isdigit():
            with self._cond:
                self._counters[kind] = max(self._counters.get(kind, 0), int(number))

    def submit(self, meta: RequestMeta, execute: Executor) -> Future:
        """Queue a request; raises :class:`DuplicateNameError` if its name is still in flight here.

        A name is in flight from submission until the caller has collected the result
        (:meth:`Future.wait`), so a second request under the same name is refused
        whether or not the first one has already run on the other ranks.
        """
        request = _Request(meta, execute, Future(lambda: self._release(meta.name)))
        with self._cond:
            if self._stopping or self._stopped:
                raise CoordinatorShutdownError(f"shardwise has been shut down; cannot run '{meta.name}'")
            if meta.name in self._in_flight:
                raise DuplicateNameError(
                    f"a collective named '{meta.name}' is already in flight on this rank; names of "
                    "concurrent collectives must be unique")
            self._in_flight.add(meta.name)
            self._pending[meta.name] = request
            self._new.append(request)
            self._start_locked()
            self._cond.notify_all()
        timeline = self._timeline()
        if timeline is not None:
            timeline.begin(meta.name, f"NEGOTIATE_{meta.kind.upper()}")
        return request.future

    def _release(self, name: str) -> None:
        with self._cond:
            self._in_flight.discard(name)

    def join(self) -> Future:
        """Announce that this rank has no more data; the future holds the last rank to join."""
        with self._cond:
            if self._join is not None:
                raise DuplicateNameError("join() is already in progress on this rank")
            if self._stopping or self._stopped:
                raise CoordinatorShutdownError("shardwise has been shut down; cannot join")
            self._join, self._join_announced = Future(), False
            self._start_locked()
            self._cond.notify_all()
            return self._join

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after the ranks agree to (collective over the set); idempotent."""
        with self._cond:
            if self._stopped or (self._thread is None and self.comm.size == 1):
                self._stopped = True
                return
            self._stopping = True
            self._start_locked()  # even a rank that never submitted must tell the others it stops
            self._cond.notify_all()
            thread = self._thread
        thread.join(timeout)
        if thread.is_alive():
            log.warning("coordinator '%s': other ranks did not shut down within %.0f s", self.label, timeout)

    def alive(self) -> bool:
        """True while the coordinator thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # -- the thread ---------------------------------------------------------------------------------
    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"shardwise-coordinator-{self.label}",
                                            daemon=True)
            self._thread.start()

    def _next_announcement(self, backoff: float) -> Announcement:
        """Wait until there is something to say (or to wait for), then take it."""
        with self._cond:
            deadline = time.monotonic() + backoff
            while True:
                has_new = bool(self._new) or self._stopping or (self._join is not None
                                                                and not self._join_announced)
                waiting = bool(self._pending) or self._join is not None
                if has_new or (waiting and time.monotonic() >= deadline):
                    break
                self._cond.wait(None if not waiting else max(deadline - time.monotonic(), 0.0))
            ann = Announcement(tuple(r.meta for r in self._new), join=self._join is not None,
                               shutdown=self._stopping)
            self._new.clear()
            if self._join is not None:
                self._join_announced = True
            return ann

    def _loop(self) -> None:
        backoff = 0.0
        while True:
            ann = self._next_announcement(backoff)
            timeline = self._timeline()
            if timeline is not None:
                timeline.cycle()
            try:
                ready, ann = self._agree(ann)
                everyone = self._exchange(ann) if ann is not None else None
            except BaseException as exc:  # the engine failed: nothing can complete any more
                self._fail_all(CoordinatorShutdownError(f"coordinator '{self.label}' lost its "
                                                        f"communicator: {exc}"))
                return
            for bit in ready:
                self._run(self._cache.response(bit))
            responses = self._negotiator.update(everyone) if everyone is not None else []
            if responses and responses[-1].kind == "shutdown":
                stopping = [r for r, a in enumerate(everyone) if a.shutdown]
                self._fail_all(CoordinatorShutdownError(f"shardwise has been shut down (on rank(s) {stopping}) "
                                                        "before every rank submitted this request"))
                return
            for response in responses:
                self._run(response)
                self._cache.put(response)
            backoff = 0.0 if responses or ready else min(max(backoff * 2, 1e-4), _MAX_BACKOFF_S)
            self._warn_stalls()

    def _agree(self, ann: Announcement) -> tuple[list[int], Optional[Announcement]]:
        """The cached requests ready on every rank, and the announcement to exchange in full (None: no full round).

        One :func:`tree_min` over ``[clean, hit bits..., kept bits...]``: ``clean`` is 0 on a rank
        with anything to say in full (a new request, join, shutdown), a hit bit is 1 on a rank
        with that cached request pending, a kept bit is 0 on a rank that submitted the bit's name
        with another meta (every rank then evicts it, and re-announces its pending one in full).
        While a rank has joined, requests are negotiated in full (the joined one contributes zeros).
        """
        cache, misses, conflicts = self._cache, [], []
        if cache.capacity == 0:  # the cache is off: every round exchanges whole announcements
            self.stats.rounds += 1
            return [], ann
        bypass = bool(self._negotiator.joined)
        if bypass and self._hits:
            misses += [self._pending[name].meta for name in self._hits.values() if name in self._pending]
            self._hits.clear()
        for meta in ann.requests:
            bit = None if bypass else cache.lookup(meta)
            if bit is not None:
                self._hits[bit] = meta.name
                continue
            misses.append(meta)
            stale = cache.bit_of(meta.name)
            if stale is not None:
                conflicts.append(stale)
        width = cache.width
        vec = np.ones(1 + 2 * width, dtype=np.uint8)
        vec[0] = 0 if (misses or ann.join or ann.shutdown) else 1
        vec[1:1 + width] = 0
        vec[[1 + b for b in self._hits]] = 1
        vec[[1 + width + b for b in conflicts]] = 0
        agreed, traffic = tree_min(self.comm, vec)
        stats = self.stats
        stats.rounds += 1
        stats.messages += traffic.messages
        stats.bytes_sent += traffic.bytes_sent
        stats.bytes_received += traffic.bytes_received
        ready = [b for b in range(width) if agreed[1 + b]]
        for bit in ready:
            self._hits.pop(bit, None)
        for bit in (b for b in range(width) if not agreed[1 + width + b]):
            name = self._hits.pop(bit, None)
            if name is not None and name in self._pending:
                misses.append(self._pending[name].meta)
            cache.evict(bit)
        if agreed[0]:
            return ready, None
        return ready, Announcement(tuple(misses), join=ann.join, shutdown=ann.shutdown)

    def _exchange(self, ann: Announcement) -> list[Announcement]:
        """Every rank's announcement of this round, in rank order (one allgather; counted in :attr:`stats`)."""
        payload = pickle.dumps(ann, protocol=pickle.HIGHEST_PROTOCOL)
        raw = self.comm.allgather_object(payload)
        stats = self.stats
        stats.full_rounds += 1
        stats.messages += 1
        stats.bytes_sent += len(payload)
        stats.bytes_received += sum(len(b) for b in raw)
        return [pickle.loads(b) for b in raw]

    def _run(self, response: Response) -> None:
        if response.kind == "join":
            with self._cond:
                future, self._join = self._join, None
            if future is not None:
                future.set_result(response.last_joined)
            return
        with self._cond:
            request = self._pending.pop(response.name, None)
        timeline = self._timeline()
        self.stats.requests += 1
        if request is None:  # a joined rank's part in the others' request
            self._catch_up(response.name)
            if response.error is None:
                joined_contribution(self.comm, response)
            return
        if timeline is not None:
            timeline.end(response.name)
        if response.error is not None:
            request.future.set_error(CollectiveMismatchError(response.error))
            return
        if timeline is not None:
            timeline.begin(response.name, response.kind.upper())
        try:
            result = request.execute(self.comm, response)
        except BaseException as exc:  # reported to the caller; the rounds go on
            request.future.set_error(exc)
        else:
            request.future.set_result(result)
        finally:
            if timeline is not None:
                timeline.end(response.name)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            self._stopped = True
            requests = list(self._pending.values())
            self._pending.clear()
            self._new.clear()
            join, self._join = self._join, None
        for request in requests:
            request.future.set_error(error)
        if join is not None:
            join.set_error(error)

    def _warn_stalls(self) -> None:
        now = time.monotonic()
        with self._cond:
            late = [r for r in self._pending.values()
                    if now - r.submitted > STALL_WARNING_S and r.meta.name not in self._warned]
        cached = set(self._hits.values())
        for request in late:
            name = request.meta.name
            self._warned.add(name)
            who = ("some rank(s) (it was announced by its response-cache bit, which names no rank)" if name in cached
                   else f"rank(s) {self._negotiator.missing(name)}")
            log.warning("coordinator '%s': '%s' has waited %.0f s; %s have not submitted it",
                        self.label, name, now - request.submitted, who)
