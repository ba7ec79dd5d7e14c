"""Generations of an elastic job: who is in it, with which rank, as the driver decides.

The driver (:class:`Membership`, in the process that hosts the
:class:`~shardwise.backends.rendezvous.store.StoreServer`) publishes each generation ``g`` as
store keys ``gen/g/size`` and ``gen/g/rank/<worker id>``, then ``latest = g``. A
worker asks for a place with ``join/<worker id> = <its last generation>`` and waits
for a generation newer than that which names it (:func:`join`). When the driver
wants a change (a worker lost or one waiting to join) it first sets ``wanted = g + 1``;
at their next commit the members see it (:func:`change_wanted`, read by rank 0)
and all stop together, ask to join, and the driver publishes ``g + 1`` once every
live member has asked, so that no one is left waiting in an older generation.

The environment the launcher gives each worker: ``SHARDWISE_RDZV_ADDR`` (host:port),
``SHARDWISE_RDZV_SECRET`` and ``SHARDWISE_WORKER_ID``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ...core.errors import ConfigError, RendezvousError
from .store import StoreClient, StoreServer

__all__ = ["Assignment", "Membership", "WorkerEndpoint", "endpoint_from_env", "join", "change_wanted"]

ADDR_ENV, SECRET_ENV, ID_ENV = "SHARDWISE_RDZV_ADDR", "SHARDWISE_RDZV_SECRET", "SHARDWISE_WORKER_ID"


@dataclass(frozen=True)
class WorkerEndpoint:
    """Where this worker's rendezvous store is and who the worker is."""

    host: str
    port: int
    secret: str
    worker_id: str

    def connect(self, timeout: float = 300.0) -> StoreClient:
        return StoreClient(self.host, self.port, self.secret, timeout=timeout)


@dataclass(frozen=True)
class Assignment:
    """This worker's place in one generation."""

    generation: int
    rank: int
    size: int


def endpoint_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[WorkerEndpoint]:
    """The elastic endpoint from the launcher's environment, or None outside an elastic job."""
    env = os.environ if env is None else env
    addr = env.get(ADDR_ENV)
    if not addr:
        return None
    host, _, port = addr.rpartition(":")
    secret, worker = env.get(SECRET_ENV, ""), env.get(ID_ENV, "")
    if not host or not port.isdigit():
        raise ConfigError(f"{ADDR_ENV}={addr!r}: expected host:port")
    if not secret or not worker:
        raise ConfigError(f"{ADDR_ENV} is set but {SECRET_ENV} or {ID_ENV} is missing")
    return WorkerEndpoint(host, int(port), secret, worker)


def join(client: StoreClient, worker_id: str, last_generation: int, timeout: float) -> Assignment:
    """Ask for a place newer than ``last_generation`` and wait until the driver gives one."""
    client.set(f"join/{worker_id}", str(last_generation).encode())
    deadline = time.monotonic() + timeout
    wanted = last_generation + 1
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"worker {worker_id} got no place in a generation after "
                                  f"{last_generation} within {timeout:g} s")
        try:
            client.wait([f"gen/{wanted}/size"], timeout=min(left, 5.0))
        except TimeoutError:
            continue
        latest = int(client.get("latest", timeout=left))
        for g in range(latest, wanted - 1, -1):
            key = f"gen/{g}/rank/{worker_id}"
            if client.check([key]):
                return Assignment(g, int(client.get(key)), int(client.get(f"gen/{g}/size")))
        wanted = latest + 1


def change_wanted(client: StoreClient, generation: int) -> bool:
    """True when the driver wants the members of ``generation`` to re-form the job."""
    return client.check(["wanted"]) and int(client.get("wanted", timeout=0.0)) > generation


class Membership:
    """The driver's side: collects join requests and publishes generations on ``server``."""

    def __init__(self, server: StoreServer) -> None:
        self.server = server
        self.generation = -1
        self.members: list[str] = []
        self._placed: dict[str, int] = {}  # worker -> the newest generation it was given a rank in

    def requests(self) -> dict[str, int]:
        """Worker id -> the last generation it was in, for every worker waiting for a place."""
        out = {}
        for key in self.server.keys("join/"):
            worker = key[len("join/"):]
            raw = self.server.get(key)
            if raw is not None and self._placed.get(worker, -1) <= int(raw):
                out[worker] = int(raw)
        return out

    def announce(self) -> None:
        """Ask the current members to stop at their next commit and join the next generation."""
        self.server.set("wanted", str(self.generation + 1).encode())

    def publish(self, members: Sequence[str]) -> int:
        """Start generation ``g + 1`` with ``members`` in rank order; returns it."""
        if not members:
            raise RendezvousError("a generation needs at least one worker")
        g = self.generation + 1
        self.server.set(f"gen/{g}/size", str(len(members)).encode())
        for rank, worker in enumerate(members):
            self.server.set(f"gen/{g}/rank/{worker}", str(rank).encode())
            self._placed[worker] = g
        self.generation, self.members = g, list(members)
        self.server.set("latest", str(g).encode())
        return g
