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

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..backends.rendezvous import Membership, StoreServer
from ..core.errors import ConfigError
from ..elastic.driver import ElasticDriver, Ended, check_sizes

__all__ = ["RayExecutor", "run"]


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


class _RayPool:
    """The driver's workers as Ray actors, each running ``fn`` once."""

    def __init__(self, actor_class: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        self.actor_class, self.fn, self.args, self.kwargs = actor_class, fn, list(args), kwargs
        self.running: dict[str, _Running] = {}

    def launch(self, worker: str, env: dict[str, str]) -> None:
        actor = self.actor_class.remote(env)
        self.running[worker] = _Running(actor, actor.execute.remote(self.fn, self.args, self.kwargs))

    def ended(self, timeout: float) -> list[Ended]:
        import ray

        futures = {r.future: w for w, r in self.running.items()}
        if not futures:
            time.sleep(timeout)
            return []
        ready, _ = ray.wait(list(futures), num_returns=1, timeout=timeout)
        out = []
        for ref in ready:
            worker = futures[ref]
            del self.running[worker]
            try:
                out.append(Ended(worker, False, ray.get(ref)))
            except ray.exceptions.RayActorError as exc:
                out.append(Ended(worker, True, str(exc)))
        return out

    def kill(self, worker: str) -> None:
        import ray

        running = self.running.pop(worker, None)
        if running is not None:
            ray.kill(running.actor, no_restart=True)


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
        self.min_workers, self.max_workers = check_sizes(num_workers, min_workers, max_workers, elastic)
        self.num_workers = num_workers
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.elastic, self.discovery_interval = elastic, discovery_interval
        self.max_failures, self.timeout = max_failures, timeout
        self.env = dict(env or {})
        self._driver: Optional[ElasticDriver] = None
        self._host = ""
        self._actor_class: Any = None

    @property
    def server(self) -> Optional[StoreServer]:
        """The running job's rendezvous store (None between jobs)."""
        return self._driver.server if self._driver is not None else None

    @property
    def membership(self) -> Optional[Membership]:
        """The running job's generations (None before the first job)."""
        return self._driver.membership if self._driver is not None else None

    @property
    def history(self) -> list[tuple[int, int]]:
        """Generations the last :meth:`run` went through: (generation, number of workers)."""
        return self._driver.history if self._driver is not None else []

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to Ray (a local instance if none is running)."""
        import ray

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=True)
        self._host = ray.util.get_node_ip_address()
        self._actor_class = ray.remote(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker)(_Worker)

    def shutdown(self) -> None:
        """Close the rendezvous store (actors end with each :meth:`run`)."""
        if self._driver is not None:
            self._driver.close()

    # -- one job ------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None) -> list:
        """``fn(*args, **kwargs)`` on every worker; the final workers' results in rank order."""
        if self._actor_class is None:
            raise ConfigError("call RayExecutor.start() before run()")
        self.shutdown()
        pool = _RayPool(self._actor_class, fn, args, kwargs or {})
        self._driver = ElasticDriver(pool, self._host, self.num_workers, elastic=self.elastic,
                                     min_workers=self.min_workers, max_workers=self.max_workers,
                                     discovery_interval=self.discovery_interval, max_failures=self.max_failures,
                                     timeout=self.timeout, env=self.env, engine="Ray")
        return self._driver.run()


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None, *,
        num_workers: int = 2, **options: Any) -> list:
    """Start a :class:`RayExecutor`, run ``fn`` on it and return the results in rank order."""
    executor = RayExecutor(num_workers, **options)
    executor.start()
    try:
        return executor.run(fn, args, kwargs)
    finally:
        executor.shutdown()
