"""Process sets (Horovod's ``hvd.ProcessSet``): collectives over a subset of the ranks.

A :class:`ProcessSet` names world ranks; :func:`add_process_set` (collective on
every rank) makes its sub-communicator with ``world.split(ranks=...)``. The
registry of added sets lives in the current :class:`~shardwise.context.Context`,
so it disappears with :func:`shardwise.shutdown`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import shardwise
from shardwise.core.comm import Communicator
from shardwise.core.errors import ConfigError

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "comm_of",
           "registered_comms"]

_REGISTRY_KEY = "torch_adapter_process_sets"


class ProcessSet:
    """A set of world ranks; usable in collectives once registered with :func:`add_process_set`.

    ``ProcessSet(None)`` is the world (see :data:`global_process_set`).
    """

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        if ranks is not None:
            ranks = sorted(int(r) for r in ranks)
            if len(set(ranks)) != len(ranks) or not ranks:
                raise ConfigError(f"a process set needs distinct ranks, got {ranks}")
        self._ranks = ranks
        self._comm: Optional[Communicator] = None
        self._context: Optional[shardwise.Context] = None
        self.process_set_id: Optional[int] = 0 if ranks is None else None

    @property
    def ranks(self) -> list[int]:
        """The world ranks in the set, ascending."""
        if self._ranks is None:
            return list(range(shardwise.current().world.size))
        return list(self._ranks)

    def is_global(self) -> bool:
        """True for the set of all ranks."""
        return self._ranks is None

    def included(self) -> bool:
        """True when this process belongs to the set."""
        return self._ranks is None or shardwise.current().world.rank in self._ranks

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 when not included)."""
        me = shardwise.current().world.rank
        return self.ranks.index(me) if me in self.ranks else -1

    @property
    def comm(self) -> Communicator:
        """The communicator of the set; raises if not registered or this rank is outside it."""
        ctx = shardwise.current()
        if self._ranks is None:
            return ctx.world
        if self.process_set_id is None or self._context is not ctx:
            raise ConfigError(f"process set {self._ranks} is not registered in the current context: "
                              "call hvd.add_process_set(process_set) on every rank first")
        if self._comm is None:
            raise ConfigError(f"rank {ctx.world.rank} is not a member of process set {self._ranks}")
        return self._comm

    def __repr__(self) -> str:
        who = "global" if self._ranks is None else f"ranks={self._ranks}"
        return f"ProcessSet(process_set_id={self.process_set_id}, {who})"


#: The process set of all ranks (the default of every collective).
global_process_set = ProcessSet(None)


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set (collective: every rank calls it with the same ranks)."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    ctx = shardwise.current()
    if ps.is_global():
        return global_process_set
    bad = [r for r in ps.ranks if not 0 <= r < ctx.world.size]
    if bad:
        raise ConfigError(f"process set ranks {bad} are outside the world of size {ctx.world.size}")
    registry: list = ctx.owned.setdefault(_REGISTRY_KEY, [])
    if ps.process_set_id is not None and ps._context is ctx:
        raise ConfigError(f"{ps!r} is already registered")
    ps._comm = ctx.world.split(ranks=ps.ranks)
    ps._context = ctx
    registry.append(ps)
    ps.process_set_id = len(registry)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and free its communicator; False if it was not registered."""
    ctx = shardwise.current()
    registry: list = ctx.owned.get(_REGISTRY_KEY, [])
    if process_set.is_global() or process_set not in registry:
        return False
    registry[registry.index(process_set)] = None
    if process_set._comm is not None:
        process_set._comm.free()
    process_set._comm, process_set._context, process_set.process_set_id = None, None, None
    return True


def registered_comms(ctx: shardwise.Context) -> list[Communicator]:
    """The communicators of the process sets registered in ``ctx`` that this rank belongs to."""
    return [ps._comm for ps in ctx.owned.get(_REGISTRY_KEY, []) if ps is not None and ps._comm is not None]


def comm_of(process_set: Optional[ProcessSet]) -> Communicator:
    """The communicator behind ``process_set`` (the world for ``None``)."""
    if process_set is None:
        return shardwise.current().world
    if isinstance(process_set, Communicator):
        return process_set
    if not isinstance(process_set, ProcessSet):
        raise ConfigError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    return process_set.comm
