"""Run a training function on Ray actors, with shardwise's torch backend set up through Ray.

The driver (this process) hosts the job's rendezvous store (secret-protected,
bound to the driver node's address) and decides each generation's members; the
actors find it through the environment it gives them and build their gloo/NCCL
group on it. With ``elastic=True`` a lost actor is dropped (the others go on from
their last commit, see :func:`shardwise.torch.elastic.run`) and replacements are
started while the job has fewer than ``max_workers`` and failures are left, as
Horovod's ``ElasticRayExecutor`` and Ray Train's ``TorchTrainer`` do.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..core.errors import ConfigError, RendezvousError
from ..backends.rendezvous import ADDR_ENV, ID_ENV, SECRET_ENV, Membership, StoreServer, new_secret

__all__ = ["RayExecutor", "run"]

_LOG = logging.getLogger("shardwise.ray")


class _Worker:
    """The actor: a process with the job's environment that runs the training function."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def execute(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        return fn(*args, **kwargs)


@dataclass
class _Running:
    actor: Any
    future: Any


@dataclass
class _Job:
    running: dict[str, _Running] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    failures: int = 0
    next_id: int = 0
    last_growth: float = 0.0


class RayExecutor:
    """``num_workers`` Ray actors training together on the torch backend (gloo on CPU, NCCL on GPU).

    ``elastic=True`` keeps the job going while at least ``min_workers`` are alive and
    grows it back up to ``max_workers`` every ``discovery_interval`` seconds, starting
    at most ``max_failures`` replacements. The function must call ``shardwise.init()``
    (or ``hvd.init()``) itself, and for an elastic job train inside
    ``hvd.elastic.run``. Call :meth:`start`, then :meth:`run` (any number of times), then
    :meth:`shutdown`.
    """

    def __init__(self, num_workers: int = 2, *, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 elastic: bool = False, min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 discovery_interval: float = 5.0, max_failures: int = 3, timeout: float = 600.0,
                 env: Optional[dict[str, str]] = None) -> None:
        if num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.min_workers = min_workers if min_workers is not None else (1 if elastic else num_workers)
        self.max_workers = max_workers if max_workers is not None else num_workers
        if not 1 <= self.min_workers <= num_workers <= self.max_workers:
            raise ConfigError(f"need 1 <= min_workers ({self.min_workers}) <= num_workers ({num_workers}) "
                              f"<= max_workers ({self.max_workers})")
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.elastic, self.discovery_interval = elastic, discovery_interval
        self.max_failures, self.timeout = max_failures, timeout
        self.env = dict(env or {})
        self.server: Optional[StoreServer] = None
        self.membership: Optional[Membership] = None
        #: Generations the last :meth:`run` went through: (generation, number of workers).
        self.history: list[tuple[int, int]] = []
        self._secret, self._host = "", ""
        self._actor_class: Any = None

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to Ray (a local instance if none is running) and open the rendezvous store."""
        import ray

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=True)
        self._host = ray.util.get_node_ip_address()
        self._secret = new_secret()
        self._actor_class = ray.remote(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker)(_Worker)

    def shutdown(self) -> None:
        """Close the rendezvous store (actors end with each :meth:`run`)."""
        if self.server is not None:
            self.server.close()
            self.server = None

    # -- one job ------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None) -> list:
        """``fn(*args, **kwargs)`` on every worker; the final workers' results in rank order."""
        import ray

        if self._actor_class is None:
            raise ConfigError("call RayExecutor.start() before run()")
        self.shutdown()
        self.server = StoreServer(self._secret, host=self._host)
        self.membership = Membership(self.server)
        self.history = []
        job = _Job()
        for _ in range(self.num_workers):
            self._launch(job, fn, args, kwargs or {})
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                if time.monotonic() > deadline:
                    raise RendezvousError(f"the Ray job did not finish within {self.timeout:g} s")
                self._collect(job, ray)
                done = self._finished(job)
                if done is not None:
                    return done
                self._form(job)
                if self.elastic and not job.results:
                    self._grow(job, fn, args, kwargs or {})
        finally:
            for running in job.running.values():
                ray.kill(running.actor, no_restart=True)
            self.shutdown()

    def _launch(self, job: _Job, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        worker = f"w{job.next_id}"
        job.next_id += 1
        env = {**self.env, ADDR_ENV: f"{self._host}:{self.server.port}", SECRET_ENV: self._secret,
               ID_ENV: worker, "SHARDWISE_BACKEND": "torch"}
        actor = self._actor_class.remote(env)
        job.running[worker] = _Running(actor, actor.execute.remote(fn, list(args), kwargs))
        job.last_growth = time.monotonic()

    def _collect(self, job: _Job, ray: Any) -> None:
        """Results of finished workers; drop the dead ones (or fail, when not elastic)."""
        futures = {r.future: w for w, r in job.running.items()}
        ready, _ = ray.wait(list(futures), num_returns=1, timeout=0.2)
        for ref in ready:
            worker = futures[ref]
            try:
                job.results[worker] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                job.failures += 1
                _LOG.warning("worker %s died: %s", worker, exc)
                if not self.elastic:
                    raise RendezvousError(f"Ray worker {worker} died: {exc}") from None
            del job.running[worker]

    def _finished(self, job: _Job) -> Optional[list]:
        members = self.membership.members
        if job.results and all(m in job.results or m not in job.running for m in members):
            return [job.results[m] for m in members if m in job.results]
        if not job.running:
            raise RendezvousError("every Ray worker is gone")
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

    def _grow(self, job: _Job, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if len(job.running) >= self.max_workers:
            return
        if job.next_id - self.num_workers >= self.max_failures + self.max_workers - self.num_workers:
            return  # replacements used up
        if time.monotonic() - job.last_growth < self.discovery_interval:
            return
        self._launch(job, fn, args, kwargs)


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None, *,
        num_workers: int = 2, **options: Any) -> list:
    """Start a :class:`RayExecutor`, run ``fn`` on it and return the results in rank order."""
    executor = RayExecutor(num_workers, **options)
    executor.start()
    try:
        return executor.run(fn, args, kwargs)
    finally:
        executor.shutdown()
