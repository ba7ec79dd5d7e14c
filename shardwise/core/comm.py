"""The one interface every backend implements: a communicator over a group of ranks.

A *tensor* here is whatever the backend accepts: every backend takes numpy arrays;
the ``mpi`` and ``torch`` backends also take torch tensors, the ``tf`` backend
TensorFlow tensors. A collective returns the same kind of object it was given.

Conventions (shared by every backend, checked by the same test suite):

* Blocking calls return the result; ``*_async`` calls return a :class:`Handle`
  whose :meth:`Handle.wait` returns the same result.
* ``inplace=True`` writes the result into the input and returns it.
* ``allgather`` and ``alltoall`` concatenate along the first dimension; the
  first dimension may differ per rank for ``allgather`` (not with ``uniform=True``,
  which lets a backend skip agreeing on it first).
* ``reduce_scatter`` splits the first dimension like :func:`numpy.array_split`:
  the remainder goes to the lowest ranks.
* A communicator of size 1 returns at once without touching the engine.
"""

from __future__ import annotations

import abc
import enum
from typing import Any, Optional, Sequence

import numpy as np

from .errors import ConfigError

__all__ = ["ReduceOp", "Handle", "CompletedHandle", "Communicator", "own_block", "split_sizes"]


class ReduceOp(str, enum.Enum):
    """Reduction operators understood by every backend."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        """Accept an enum member or a case-insensitive name (``avg`` and ``prod`` too)."""
        if isinstance(op, ReduceOp):
            return op
        key = str(op).strip().lower()
        aliases = {"avg": "average", "mean": "average", "prod": "product"}
        key = aliases.get(key, key)
        try:
            return cls(key)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown reduce op {op!r}; expected one of: {names}") from None


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous pieces of ``total``, remainder to the lowest indices."""
    if parts <= 0:
        raise ConfigError(f"cannot split into {parts} parts")
    base, rem = divmod(total, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


class Handle(abc.ABC):
    """An operation in flight; :meth:`wait` completes it and returns its result."""

    @abc.abstractmethod
    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the operation completes and return its result.

        ``timeout`` (seconds) bounds the wait; on expiry a
        :class:`~shardwise.core.errors.CollectiveTimeoutError` is raised.
        """

    @abc.abstractmethod
    def done(self) -> bool:
        """True when :meth:`wait` would return without blocking."""


class CompletedHandle(Handle):
    """A handle whose result is already known (size-1 groups, blocking fallbacks)."""

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def wait(self, timeout: Optional[float] = None) -> Any:
        return self._result

    def done(self) -> bool:
        return True


class _CopiedInto(Handle):
    """An allgather's result copied into a caller's buffer when waited for."""

    def __init__(self, inner: Handle, out: Any) -> None:
        self._inner, self._out, self._copied = inner, out, False

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        result = self._inner.wait(timeout)
        if not self._copied:
            if hasattr(self._out, "copy_"):  # a torch tensor (no framework import here)
                self._out.copy_(result)
            else:
                np.copyto(self._out, np.asarray(result).reshape(np.shape(self._out)))
            self._copied = True
        return self._out


def own_block(tensor: Any, rank: int, size: int) -> Any:
    """Rank ``rank``'s rows of ``tensor`` when its first dimension is split ``size`` ways (a view)."""
    rows = split_sizes(int(tensor.shape[0]), size)
    start = sum(rows[:rank])
    return tensor[start:start + rows[rank]]


class Communicator(abc.ABC):
    """A group of ranks that can run collectives together.

    Implementations live in :mod:`shardwise.backends`; adapters and core plans use
    only this interface.
    """

    #: Backend name, e.g. ``"mpi"``, ``"torch"``, ``"local"``.
    backend: str = "abstract"

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank within the communicator."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of ranks in the communicator."""

    # -- reductions ---------------------------------------------------------------
    @abc.abstractmethod
    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        inplace: bool = False, name: Optional[str] = None) -> Handle:
        """Start an allreduce; the handle's result is the reduced tensor."""

    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                  inplace: bool = False, name: Optional[str] = None) -> Any:
        """Reduce ``tensor`` elementwise over all ranks; every rank gets the result."""
        return self.allreduce_async(tensor, op, inplace=inplace, name=name).wait()

    @abc.abstractmethod
    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        """Start a reduce-scatter; the result is this rank's rows of the reduction."""

    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                       name: Optional[str] = None) -> Any:
        """Reduce over ranks, then keep this rank's block of rows (array_split order)."""
        return self.reduce_scatter_async(tensor, op, name=name).wait()

    def reduce_scatter_in_place_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                                      name: Optional[str] = None) -> Handle:
        """Start a reduce-scatter whose result lands in this rank's own block of ``tensor``.

        The handle's result is that block (a view of ``tensor``, rows in array_split
        order); the other blocks keep their values. Backends that can reduce straight
        into the block override this; the default reduces out of place, then copies.
        """
        return _CopiedInto(self.reduce_scatter_async(tensor, op, name=name), own_block(tensor, self.rank, self.size))

    # -- data movement ------------------------------------------------------------
    @abc.abstractmethod
    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        """Start an allgather; the result is every rank's tensor concatenated on dim 0.

        ``uniform=True`` promises that every rank passes the same shape and dtype, so
        backends skip the (blocking) exchange of first dimensions that uneven inputs need.
        """

    def allgather(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Any:
        """Concatenate every rank's tensor along dim 0 (first dims may differ unless ``uniform``)."""
        return self.allgather_async(tensor, name=name, uniform=uniform).wait()

    def allgather_into_async(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Handle:
        """Start an allgather of equal-shaped ``tensor`` into the preallocated ``out`` (rank order).

        ``out`` has ``size`` times ``tensor``'s first dimension; ``tensor`` may be this
        rank's own block of ``out`` (in place). The handle's result is ``out``. Backends
        that can write straight into ``out`` override this; the default gathers, then copies.
        """
        return _CopiedInto(self.allgather_async(tensor, name=name, uniform=True), out)

    def allgather_into(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Any:
        """Blocking :meth:`allgather_into_async`: returns ``out``. The default gathers, then copies."""
        return _CopiedInto(CompletedHandle(self.allgather(tensor, name=name, uniform=True)), out).wait()

    @abc.abstractmethod
    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        """Start a broadcast from ``root``."""

    def broadcast(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                  name: Optional[str] = None) -> Any:
        """Every rank gets ``root``'s tensor (shapes must match)."""
        return self.broadcast_async(tensor, root, inplace=inplace, name=name).wait()

    @abc.abstractmethod
    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
        """Start an all-to-all exchange of dim-0 blocks."""

    def alltoall(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                 recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Any:
        """Send block ``i`` of dim 0 to rank ``i``; return the received blocks in rank order.

        ``splits`` gives the number of rows sent to each rank; without it dim 0 must
        divide evenly by :attr:`size`. ``recv_splits``, where the caller knows them, are the
        rows each rank sends here: a backend may then skip exchanging the counts (torch's does).
        """
        return self.alltoall_async(tensor, splits, recv_splits=recv_splits, name=name).wait()

    # -- point to point -----------------------------------------------------------
    @abc.abstractmethod
    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        """Start sending ``tensor`` to ``dest``."""

    def send(self, tensor: Any, dest: int, tag: int = 0) -> None:
        """Send ``tensor`` to ``dest`` (blocks until the buffer may be reused)."""
        self.send_async(tensor, dest, tag).wait()

    @abc.abstractmethod
    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        """Start receiving into ``tensor`` from ``source``."""

    def recv(self, tensor: Any, source: int, tag: int = 0) -> Any:
        """Receive into ``tensor`` (same shape and dtype as sent) and return it."""
        return self.recv_async(tensor, source, tag).wait()

    # -- control ------------------------------------------------------------------
    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""

    @abc.abstractmethod
    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["Communicator"]:
        """Collective: make sub-communicators.

        With ``color``: ranks passing the same colour form one group, ordered by
        ``key`` (default: current rank). With ``ranks``: one group of those ranks,
        in that order; non-members get ``None``. Every rank must call it.
        """

    def duplicate(self) -> "Communicator":
        """Collective: a communicator over the same ranks in the same order, with a message space of its own.

        Like ``MPI_Comm_dup``. Engines that keep one connection per pair of ranks give the
        duplicate connections of its own, so traffic on it does not queue behind this one's.
        """
        dup = self.split(color=0)
        if dup is None:  # pragma: no cover - every rank passes colour 0
            raise RuntimeError("split(color=0) left this rank out")
        return dup

    def thread_safe_duplicate(self) -> Optional["Communicator"]:
        """Collective: a duplicate that a second thread may call while other threads call this
        communicator (and the job's other communicators), or ``None`` on every rank where the
        backend cannot promise that (the caller then keeps every collective on one thread).

        The default promises nothing. ``mpi``: a duplicate when MPI runs at
        ``MPI_THREAD_MULTIPLE`` on every rank; ``torch``: a gloo group of its own.
        """
        return None

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank, in rank order."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return ``root``'s picklable object on every rank."""

    @abc.abstractmethod
    def abort(self, code: int = 1) -> None:
        """Terminate every process of the job (used when one rank fails)."""

    def free(self) -> None:
        """Release engine resources held by this communicator (idempotent)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend} rank={self.rank} size={self.size}>"

