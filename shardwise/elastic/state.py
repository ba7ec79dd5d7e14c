"""Horovod's elastic state objects, framework-neutral: commit, restore, sync, host updates.

A :class:`State` keeps a copy of the training state as of the last
:meth:`~State.commit`. When a worker is lost, :func:`shardwise.elastic.run` calls
:meth:`~State.restore` (back to that copy) and, once the job has re-formed,
:meth:`~State.sync` (rank 0's copy to everyone, so that added workers start from
it). Collectives go through the current world communicator, so a state built
before a reset keeps working after it.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

from .. import context
from ..backends.rendezvous import change_wanted
from ..core.errors import HostsUpdatedInterrupt

__all__ = ["State", "ObjectState", "broadcast_object", "rank"]


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``obj`` from ``root_rank`` on every rank of the current world."""
    world = context.current().world
    return obj if world.size == 1 else world.broadcast_object(obj, root_rank)


def rank() -> int:
    return context.current().world.rank


def _generation_changed() -> bool:
    """On rank 0: does the driver want this generation to re-form? (False outside an elastic job)."""
    ctx = context.current()
    control = ctx.owned.get("elastic")
    if control is None:
        return False
    return change_wanted(control, ctx.owned["elastic_generation"])


class State:
    """Training state that survives workers coming and going (Horovod's ``hvd.elastic.State``)."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call ``callbacks`` after every reset (e.g. to rescale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state as the one to return to; then :meth:`check_host_updates`."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank at once if workers were added or lost."""
        if context.current().owned.get("elastic") is None:
            return
        changed = _generation_changed() if rank() == 0 else False
        if broadcast_object(changed):
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Copy the state to host memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Return to the last committed state."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adapt to the new set of workers (before :meth:`sync`)."""


class ObjectState(State):
    """Plain Python attributes (``epoch=0, batch=0, ...``), committed by deep copy."""

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object, get_rank: Callable[[], int] = rank,
                 **kwargs: Any) -> None:
        self._bcast_object, self._get_rank = bcast_object, get_rank
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__()

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
