"""The driver of a job whose workers an engine starts (Ray actors, Spark tasks): rendezvous and generations.

The driver hosts the job's rendezvous store (secret-protected) and decides each
generation's members. The engine is a :class:`WorkerPool`: it starts a worker with
the environment the driver gives it and reports each worker that ended, with its
result or as lost. With ``elastic=True`` a lost worker is dropped (the others go on
from their last commit, see :func:`shardwise.torch.elastic.run`) and replacements are
started while the job has fewer than ``max_workers`` and failures are left, as
Horovod's elastic drivers do; without it a lost worker fails the job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from ..backends.rendezvous import ADDR_ENV, ID_ENV, SECRET_ENV, Membership, StoreServer, new_secret
from ..core.errors import ConfigError, RendezvousError

__all__ = ["Ended", "WorkerPool", "ElasticDriver", "check_sizes"]

_LOG = logging.getLogger("shardwise.elastic")


@dataclass(frozen=True)
class Ended:
    """A worker that ended: ``lost`` (its process or task died: ``value`` says how) or its result."""

    worker: str
    lost: bool
    value: Any


class WorkerPool(Protocol):
    """What an engine does for the driver."""

    def launch(self, worker: str, env: dict[str, str]) -> None:
        """Start ``worker`` (an id) with ``env`` added to its environment."""

    def ended(self, timeout: float) -> list[Ended]:
        """The workers that ended since the last call (waiting up to ``timeout`` s for one).

        A worker whose function raised makes this raise (the job fails, elastic or not).
        """

    def kill(self, worker: str) -> None:
        """Stop ``worker`` if it still runs."""


def check_sizes(num_workers: int, min_workers: Optional[int], max_workers: Optional[int],
                elastic: bool) -> tuple[int, int]:
    """``(min_workers, max_workers)`` with their defaults, or a ConfigError naming the bad sizes."""
    if num_workers < 1:
        raise ConfigError(f"the number of workers must be >= 1, got {num_workers}")
    low = min_workers if min_workers is not None else (1 if elastic else num_workers)
    high = max_workers if max_workers is not None else num_workers
    if not 1 <= low <= num_workers <= high:
        raise ConfigError(f"need 1 <= min workers ({low}) <= workers ({num_workers}) <= max workers ({high})")
    return low, high


@dataclass
class _Job:
    running: set[str] = field(default_factory=set)
    results: dict[str, Any] = field(default_factory=dict)
    failures: int = 0
    next_id: int = 0
    last_growth: float = 0.0


class ElasticDriver:
    """One job of ``num_workers`` workers started by ``pool``, reachable at ``host``."""

    def __init__(self, pool: WorkerPool, host: str, num_workers: int, *, elastic: bool = False,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 discovery_interval: float = 5.0, max_failures: int = 3, timeout: float = 600.0,
                 start_timeout: Optional[float] = None, env: Optional[dict[str, str]] = None,
                 engine: str = "engine") -> None:
        self.min_workers, self.max_workers = check_sizes(num_workers, min_workers, max_workers, elastic)
        self.pool, self.host, self.num_workers = pool, host, num_workers
        self.elastic, self.discovery_interval = elastic, discovery_interval
        self.max_failures, self.timeout, self.start_timeout = max_failures, timeout, start_timeout
        self.env, self.engine = dict(env or {}), engine
        self.secret = new_secret()
        self.server: Optional[StoreServer] = None
        self.membership: Optional[Membership] = None
        #: Generations the last :meth:`run` went through: (generation, number of workers).
        self.history: list[tuple[int, int]] = []

    def run(self) -> list:
        """Start the workers and drive the job; the final members' results in rank order."""
        self.server = StoreServer(self.secret, host=self.host)
        self.membership = Membership(self.server)
        self.history = []
        job = _Job()
        for _ in range(self.num_workers):
            self._launch(job)
        started = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now - started > self.timeout:
                    raise RendezvousError(f"the {self.engine} job did not finish within {self.timeout:g} s")
                if self.start_timeout is not None and self.membership.generation < 0 \
                        and now - started > self.start_timeout:
                    waiting = len(self.membership.requests())
                    raise RendezvousError(f"only {waiting} of {self.num_workers} {self.engine} workers started "
                                          f"within start_timeout={self.start_timeout:g} s")
                self._collect(job)
                done = self._finished(job)
                if done is not None:
                    return done
                self._form(job)
                if self.elastic and not job.results:
                    self._grow(job)
        finally:
            for worker in list(job.running):
                self.pool.kill(worker)
            self.close()

    def close(self) -> None:
        """Close the rendezvous store."""
        if self.server is not None:
            self.server.close()
            self.server = None

    def _launch(self, job: _Job) -> None:
        worker = f"w{job.next_id}"
        job.next_id += 1
        env = {**self.env, ADDR_ENV: f"{self.host}:{self.server.port}", SECRET_ENV: self.secret, ID_ENV: worker,
               "SHARDWISE_BACKEND": "torch"}
        self.pool.launch(worker, env)
        job.running.add(worker)
        job.last_growth = time.monotonic()

    def _collect(self, job: _Job) -> None:
        """Results of finished workers; drop the lost ones (or fail, when not elastic)."""
        for end in self.pool.ended(timeout=0.2):
            job.running.discard(end.worker)
            if not end.lost:
                job.results[end.worker] = end.value
                continue
            job.failures += 1
            _LOG.warning("worker %s was lost: %s", end.worker, end.value)
            if not self.elastic:
                raise RendezvousError(f"{self.engine} worker {end.worker} was lost: {end.value}")

    def _finished(self, job: _Job) -> Optional[list]:
        members = self.membership.members
        if job.results and all(m in job.results or m not in job.running for m in members):
            return [job.results[m] for m in members if m in job.results]
        if not job.running:
            raise RendezvousError(f"every {self.engine} worker is gone")
        return None

    def _form(self, job: _Job) -> None:
        """Re-form the job when a member died, a member asks, or newcomers wait.

        The members are first told to stop at their next commit; the new
        generation is published once every live member has asked for it.
        """
        members = self.membership.members
        alive = [m for m in members if m in job.running]
        waiting = self.membership.requests()
        newcomers = sorted((w for w in waiting if w not in members and w in job.running), key=lambda w: int(w[1:]))
        if self.membership.generation < 0:
            if len(newcomers) >= self.num_workers:
                self._publish(newcomers[:self.max_workers])
            return
        if job.results:
            return  # finishing: no more changes
        if len(alive) == len(members) and not newcomers and not any(m in waiting for m in members):
            return
        self.membership.announce()
        if any(m not in waiting for m in alive):
            return  # a live member has not stopped yet (it will at its next commit or failed collective)
        candidates = alive + newcomers
        if len(candidates) >= self.min_workers:
            self._publish(candidates[:self.max_workers])

    def _publish(self, members: list[str]) -> None:
        g = self.membership.publish(members)
        self.history.append((g, len(members)))
        _LOG.info("generation %d: %d workers %s", g, len(members), members)

    def _grow(self, job: _Job) -> None:
        if len(job.running) >= self.max_workers:
            return
        if job.next_id - self.num_workers >= self.max_failures + self.max_workers - self.num_workers:
            return  # replacements used up
        if time.monotonic() - job.last_growth < self.discovery_interval:
            return
        self._launch(job)
