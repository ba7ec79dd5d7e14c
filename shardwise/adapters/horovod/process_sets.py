"""Process sets (Horovod's ``hvd.ProcessSet``) and the coordinator behind each, for every framework module.

A :class:`ProcessSet` names world ranks; :func:`add_process_set` (collective on
every rank) makes its sub-communicator with ``world.split(ranks=...)``, and a
second, private one for its :class:`~shardwise.adapters.horovod.coordinator.Coordinator`.
The registry of added sets, the coordinators and the timeline live in the current
:class:`~shardwise.context.Context` (``ctx.owned``), so they go with
:func:`shardwise.shutdown`. ``shardwise.torch``, ``shardwise.tensorflow`` and
``shardwise.keras`` share them: a set added through one module works in the others.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from ... import context
from shardwise.core.comm import Communicator
from shardwise.core.errors import ConfigError

from .coordinator import Coordinator
from .timeline import HorovodTimeline

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "comm_of",
           "registered_comms", "coordinator_of", "process_set_by_id", "start_timeline", "stop_timeline",
           "shutdown_coordinators"]

_REGISTRY_KEY = "hvd_process_sets"
_GLOBAL_KEY = "hvd_global_coordinator"
_TIMELINE_KEY = "hvd_timeline"


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
        self._coordinator: Optional[Coordinator] = None
        self._context: Optional[context.Context] = None
        self.process_set_id: Optional[int] = 0 if ranks is None else None

    @property
    def ranks(self) -> list[int]:
        """The world ranks in the set, ascending."""
        if self._ranks is None:
            return list(range(context.current().world.size))
        return list(self._ranks)

    def is_global(self) -> bool:
        """True for the set of all ranks."""
        return self._ranks is None

    def included(self) -> bool:
        """True when this process belongs to the set."""
        return self._ranks is None or context.current().world.rank in self._ranks

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 when not included)."""
        me = context.current().world.rank
        return self.ranks.index(me) if me in self.ranks else -1

    def _check_registered(self) -> context.Context:
        ctx = context.current()
        if self.process_set_id is None or self._context is not ctx:
            raise ConfigError(f"process set {self._ranks} is not registered in the current context: "
                              "call hvd.add_process_set(process_set) on every rank first")
        if self._comm is None:
            raise ConfigError(f"rank {ctx.world.rank} is not a member of process set {self._ranks}")
        return ctx

    @property
    def comm(self) -> Communicator:
        """The communicator of the set; raises if not registered or this rank is outside it."""
        if self._ranks is None:
            return context.current().world
        self._check_registered()
        return self._comm  # type: ignore[return-value]  # _check_registered saw it set

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator that negotiates this set's named collectives."""
        if self._ranks is None:
            return _global_coordinator(context.current())
        self._check_registered()
        if self._coordinator is None:
            raise ConfigError(f"rank {context.current().world.rank} is not a member of process set "
                              f"{self._ranks}")
        return self._coordinator

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self._ranks == other._ranks and \
            self.process_set_id == other.process_set_id

    def __hash__(self) -> int:
        return hash((tuple(self._ranks or ()), self.process_set_id))

    def __repr__(self) -> str:
        who = "global" if self._ranks is None else f"ranks={self._ranks}"
        return f"ProcessSet(process_set_id={self.process_set_id}, {who})"


#: The process set of all ranks (the default of every collective).
global_process_set = ProcessSet(None)


def _timeline_of(ctx: context.Context):
    return lambda: ctx.owned.get(_TIMELINE_KEY)


def _global_coordinator(ctx: context.Context) -> Coordinator:
    coordinator = ctx.owned.get(_GLOBAL_KEY)
    if coordinator is None:
        # Collective: every rank reaches its first Horovod-style call (or init) in the same order.
        comm = ctx.world.split(ranks=range(ctx.world.size)) if ctx.world.size > 1 else ctx.world
        coordinator = ctx.owned[_GLOBAL_KEY] = Coordinator(comm, label="global", timeline=_timeline_of(ctx))
        ctx.closers.append(lambda: _close(coordinator, comm is not ctx.world))
    return coordinator


def _close(coordinator: Coordinator, free: bool) -> None:
    coordinator.shutdown()
    if free and not coordinator.alive():
        coordinator.comm.free()


def ensure_global_coordinator() -> Coordinator:
    """Create the world's coordinator now (collective); Horovod-style ``init`` calls this."""
    return _global_coordinator(context.current())


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set (collective: every rank calls it with the same ranks)."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    ctx = context.current()
    if ps.is_global():
        return global_process_set
    bad = [r for r in ps.ranks if not 0 <= r < ctx.world.size]
    if bad:
        raise ConfigError(f"process set ranks {bad} are outside the world of size {ctx.world.size}")
    registry: list = ctx.owned.setdefault(_REGISTRY_KEY, [])
    if ps.process_set_id is not None and ps._context is ctx:
        raise ConfigError(f"{ps!r} is already registered")
    same = [other for other in registry if other is not None and other.ranks == ps.ranks]
    if same:
        raise ValueError(f"a process set with ranks {ps.ranks} is already registered as {same[0]!r}")
    ps._comm = ctx.world.split(ranks=ps.ranks)
    private = ctx.world.split(ranks=ps.ranks)
    ps._coordinator = None if private is None else Coordinator(
        private, label=f"set{len(registry) + 1}", timeline=_timeline_of(ctx))
    ps._context = ctx
    registry.append(ps)
    ps.process_set_id = len(registry)
    if ps._coordinator is not None:
        ctx.closers.append(lambda c=ps._coordinator: _close(c, True))
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and free its communicators; False if it was not registered."""
    ctx = context.current()
    registry: list = ctx.owned.get(_REGISTRY_KEY, [])
    if process_set.is_global() or process_set not in registry:
        return False
    registry[registry.index(process_set)] = None
    if process_set._coordinator is not None:
        _close(process_set._coordinator, True)
    if process_set._comm is not None:
        process_set._comm.free()
    process_set._comm, process_set._coordinator = None, None
    process_set._context, process_set.process_set_id = None, None
    return True


def process_set_by_id(process_set_id: int) -> Optional[ProcessSet]:
    """The registered process set with this id (0 is the world), or None."""
    if process_set_id == 0:
        return global_process_set
    registry = context.current().owned.get(_REGISTRY_KEY, [])
    if 0 < process_set_id <= len(registry):
        return registry[process_set_id - 1]
    return None


def registered_comms(ctx: context.Context) -> list[Communicator]:
    """The communicators of the process sets registered in ``ctx`` that this rank belongs to."""
    return [ps._comm for ps in ctx.owned.get(_REGISTRY_KEY, []) if ps is not None and ps._comm is not None]


def shutdown_coordinators(ctx: context.Context) -> None:
    """Stop every coordinator of ``ctx`` (collective), before the engine is torn down."""
    for close in reversed(ctx.closers):
        close()
    ctx.closers.clear()


def comm_of(process_set: Optional[ProcessSet]) -> Communicator:
    """The communicator behind ``process_set`` (the world for ``None``)."""
    if process_set is None:
        return context.current().world
    if isinstance(process_set, Communicator):
        return process_set
    if not isinstance(process_set, ProcessSet):
        raise ConfigError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    return process_set.comm


def coordinator_of(process_set: Optional[ProcessSet]) -> Coordinator:
    """The coordinator of ``process_set`` (the world's for ``None``)."""
    if process_set is None:
        return _global_coordinator(context.current())
    if not isinstance(process_set, ProcessSet):
        raise ConfigError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    return process_set.coordinator


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record Horovod's timeline of named collectives into ``file_path`` (written by :func:`stop_timeline`)."""
    ctx = context.current()
    old = ctx.owned.get(_TIMELINE_KEY)
    if old is not None:
        old.stop()
    ctx.owned[_TIMELINE_KEY] = HorovodTimeline(file_path, mark_cycles=mark_cycles, rank=ctx.world.rank)


def stop_timeline() -> None:
    """Stop recording and write the timeline file (rank 0)."""
    ctx = context.current()
    timeline = ctx.owned.pop(_TIMELINE_KEY, None)
    if timeline is not None:
        timeline.stop()
