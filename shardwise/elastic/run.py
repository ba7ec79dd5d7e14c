"""The elastic training loop: run, and on a lost or added worker restore, re-form and go again."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, TypeVar

from .. import context
from ..core.errors import CollectiveTimeoutError, HostsUpdatedInterrupt, is_peer_loss
from .state import State

__all__ = ["run_fn", "reset"]

_LOG = logging.getLogger("shardwise.elastic")
F = TypeVar("F", bound=Callable[..., Any])


def reset(lost: bool = False) -> None:
    """Leave the current generation (abruptly if a rank was ``lost``) and join the next one."""
    backend = context.current().backend if context.is_initialized() else None
    if lost and context.is_initialized():
        context.abort_connections(context.current())
    context.shutdown()
    context.init(backend)


def _where() -> str:
    if not context.is_initialized():
        return "not initialised"
    world = context.current().world
    return f"rank {world.rank} of {world.size}"


def run_fn(func: Callable[..., Any], reset_fn: Optional[Callable[[bool], None]] = None) -> Callable[..., Any]:
    """Wrap ``func(state, ...)`` so that it survives workers leaving or joining (Horovod's ``elastic.run``).

    Before each attempt the state is synchronised from rank 0. A lost worker
    (:class:`~shardwise.core.errors.WorkerLostError`, an engine's connection error,
    or a collective timeout) restores the last commit; a
    :class:`~shardwise.core.errors.HostsUpdatedInterrupt` keeps the current state.
    Either way the process joins the next generation and calls ``func`` again.
    Collectives must not run in the wrapped function's caller, only inside it.
    ``reset_fn(lost)`` leaves and re-joins (``lost``: the old group is broken).
    """
    do_reset = reset_fn if reset_fn is not None else reset

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync, lost = False, False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                _LOG.info("workers changed: re-forming the job")
                skip_sync, lost = exc.skip_sync, False
            except (RuntimeError, CollectiveTimeoutError) as exc:
                if not (is_peer_loss(exc) or isinstance(exc, CollectiveTimeoutError)):
                    raise
                _LOG.warning("lost a worker (%s): back to the last commit", exc)
                state.restore()
                skip_sync, lost = False, True
            do_reset(lost)
            _LOG.info("re-formed: %s", _where())
            state.on_reset()

    return wrapper
