"""All-or-nothing loads: the ranks agree that every one of them read its part before any state changes.

A load reads and checks what this rank needs into staging first, then calls
:func:`agree_loaded` with the error it met (or None). That one small collective
tells every rank whether any rank failed; if one did, every rank raises the same
:class:`CheckpointError`, naming the failing rank(s) and their message, and no rank
has changed its model, optimizer, generators or step. Only after it returns does a
load copy the staged values in::

    try:
        staged = read_everything_this_rank_needs(...)
        failure = None
    except CheckpointError as exc:
        staged, failure = None, exc
    agree_loaded(comm, failure, where)  # raises on every rank, or on none
    apply(staged)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

from ..core.comm import Communicator
from ..core.errors import CheckpointError

__all__ = ["agree_loaded", "stage_or_fail"]

T = TypeVar("T")


def agree_loaded(comm: Optional[Communicator], failure: Optional[BaseException], what: str = "checkpoint") -> None:
    """Collective over ``comm``: raise the same :class:`CheckpointError` on every rank if ``failure`` is
    set on any rank; return on every rank otherwise.

    ``failure`` is this rank's error while reading/checking its part (None when it read
    everything). The message names every failing rank and the first one's error, so
    each rank's log says the same thing.
    """
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    every = comm.allgather_object(mine) if comm is not None and comm.size > 1 else [mine]
    failed = [(r, msg) for r, msg in enumerate(every) if msg is not None]
    if not failed:
        return
    ranks = ", ".join(str(r) for r, _ in failed)
    first_rank, first = failed[0]
    more = f" (and {len(failed) - 1} more rank(s) failed: {ranks})" if len(failed) > 1 else ""
    raise CheckpointError(f"loading {what} failed on rank {first_rank}{more}; nothing was changed on any rank. "
                          f"Rank {first_rank}: {first}") from (failure if failure is not None else None)


def stage_or_fail(comm: Optional[Communicator], read: Callable[[], T], what: str = "checkpoint") -> T:
    """Call ``read()`` (which must change no live state), then agree: return its result on every rank,
    or raise the same :class:`CheckpointError` on every rank if it raised on any."""
    result: Any = None
    failure: Optional[BaseException] = None
    try:
        result = read()
    except Exception as exc:  # any failure of one rank's read must reach every rank, not hang them
        failure = exc
    agree_loaded(comm, failure, what)
    return result
