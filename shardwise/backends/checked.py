"""A communicator wrapper that turns mismatched or missing collectives into errors.

:class:`CheckedCommunicator` delegates everything to an inner communicator, but
before each collective the ranks compare a small descriptor of the call
(sequence number, kind, name, reduce op, dtype, shape, root). A disagreement
raises :class:`~shardwise.core.errors.CollectiveMismatchError` on *every* rank,
before any data moves, naming the ranks and what differed::

    allreduce #12 'grad_bucket_3': rank 1 has shape (17, 17, 17) float32,
    ranks 0, 2, 3 have (16, 16, 16) float32

A mismatch leaves the communicator usable: no data collective was started.

Without a timeout the comparison is one allgather of ``10`` int64 per rank. With a
timeout it is an arrival handshake (see :mod:`._arrival`): point-to-point through
rank 0, or for the torch backend through its rendezvous store, so that a rank
that never comes is named: ``allreduce #7 'x' timed out after 5 s: ranks [1]
never arrived``. With a timeout over a torch communicator, constructing the
wrapper is collective (the ranks agree on a store key prefix).

What is caught: a rank calling a different collective, name, op, root, dtype or
shape at the same point -- which includes a rank that *skipped* a call, since its
next call then pairs with the others' skipped one. A skipped call that looks
exactly like the next one (same op, name and shape, e.g. one iteration fewer of a
loop) cannot be told apart at that point; the surplus call on the other ranks then
pairs with the short rank's next different call, or with its ``free()`` at
shutdown (a mismatch), or, with a timeout, raises a timeout naming that rank.
Sequence numbers count calls per rank; they label errors and expose stale
handshake messages after a caught timeout.

``every=N`` compares only every N-th call, folding the calls in between into a
running digest: a divergence is still reported (with the first differing call
named), but up to N-1 calls late, and those unchecked calls ran paired with the
wrong partners -- they may have hung, failed inside the engine or produced wrong
results. Use ``every > 1`` only when the per-call latency matters more.

Reserved: point-to-point tag :data:`._arrival.HANDSHAKE_TAG` on the inner communicator.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from ..core.comm import Communicator, Handle, ReduceOp
from ..core.errors import CollectiveMismatchError, CollectiveTimeoutError, ConfigError
from ._arrival import arrive, store_arrive
from ._call_desc import (UNIFORM, VECTOR_LEN, CallDesc, chain_digest, describe_mismatch, describe_tensor,
                         first_divergence)

__all__ = ["CheckedCommunicator"]


def _torch_store() -> Any:
    """The default ``torch.distributed`` store (a private torch API), or None if it cannot be had."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return None


class _LabelledHandle(Handle):
    """Forward to the inner handle; a timeout error names the collective."""

    def __init__(self, inner: Handle, label: str) -> None:
        self._inner, self._label = inner, label

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        with _labelled(self._label):
            return self._inner.wait(timeout)


@contextlib.contextmanager
def _labelled(label: str) -> Iterator[None]:
    try:
        yield
    except CollectiveTimeoutError as exc:
        raise CollectiveTimeoutError(f"{label}: every rank arrived, but the transfer did not finish: {exc}") from exc


class CheckedCommunicator(Communicator):
    """Wrap ``inner`` so that ranks verify they make the same collective before making it."""

    def __init__(self, inner: Communicator, *, every: int = 1, timeout: Optional[float] = None) -> None:
        if int(every) < 1:
            raise ConfigError(f"every must be a positive number of calls, got {every}")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"timeout must be positive seconds, got {timeout}")
        self._inner = inner
        self.backend = inner.backend
        self.every = int(every)
        self.timeout = timeout if timeout is not None else getattr(inner, "timeout", None)
        self._seq = 0
        self._pending: list[CallDesc] = []
        self._digest = 0
        self._freed = False
        self._store: Any = None
        self._store_prefix = ""
        self._last_checked: Optional[int] = None
        if self.timeout is not None and inner.backend == "torch" and inner.size > 1:
            self._store = _torch_store()
            token = inner.broadcast_object(uuid.uuid4().hex if inner.rank == 0 else None, 0)
            self._store_prefix = f"shardwise/check/{token}"

    @property
    def inner(self) -> Communicator:
        """The wrapped communicator."""
        return self._inner

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def size(self) -> int:
        return self._inner.size

    def __getattr__(self, item: str) -> Any:
        # Backend extras (mpi_comm, process_group, chunk_bytes) stay reachable; they are unchecked.
        if item.startswith("__") or "_inner" not in self.__dict__:
            raise AttributeError(item)
        return getattr(self._inner, item)

    # -- the check ---------------------------------------------------------------------
    def _enter(self, kind: str, tensor: Any = None, *, name: Optional[str] = None, op: Optional[str] = None,
               root: Optional[int] = None, extra: Optional[str] = None) -> str:
        """Agree with every rank on this call (or record it for the next check); return its label."""
        self._seq += 1
        dtype, shape = describe_tensor(tensor) if tensor is not None else (None, None)
        desc = CallDesc(self._seq, kind, name, op, dtype, shape, root, extra)
        if self._inner.size == 1:
            return desc.label()
        if self._seq % self.every and kind != "free":
            self._pending.append(desc)
            self._digest = chain_digest(self._digest, desc)
            return desc.label()
        history, digest = self._pending + [desc], self._digest
        self._pending, self._digest = [], 0
        vec = desc.encode(digest)
        if self._store is not None:
            table = store_arrive(self._store, self._store_prefix, self.rank, self.size, vec, self.timeout,
                                 desc.label(), self._last_checked)
            self._last_checked = desc.seq
            agree = bool((table == vec).all())
        elif self.timeout is None or self.backend == "torch":  # torch without a store: gloo's timeout
            table = self._exchange(vec)
            agree = bool((table == vec).all())
        else:
            agree = arrive(self._inner, vec, self.timeout, desc.label())
        if not agree:
            self._raise_mismatch(history)
        return desc.label()

    def _exchange(self, vec: np.ndarray) -> np.ndarray:
        """Every rank's descriptor vector, in rank order (one small allgather)."""
        mpi = getattr(self._inner, "mpi_comm", None)
        if mpi is not None:
            table = np.empty((self._inner.size, VECTOR_LEN), dtype=np.int64)
            mpi.Allgather(vec, table)
            return table
        return np.asarray(self._inner.allgather(vec.reshape(1, VECTOR_LEN))).reshape(-1, VECTOR_LEN)

    def _raise_mismatch(self, history: list[CallDesc]) -> None:
        """Every rank got here together: share the readable descriptions and raise."""
        histories = self._inner.allgather_object(history)
        at = first_divergence(histories)
        if at < 0:
            raise CollectiveMismatchError(
                f"{history[-1].label()}: ranks disagree on the call descriptor but the descriptions match "
                "(ranks run different shardwise versions?)")
        message = describe_mismatch([h[at] for h in histories])
        if at < len(history) - 1:
            message += (f" (found at the check of collective #{history[-1].seq}; with every={self.every} "
                        "the calls in between ran unchecked, so their results may be wrong)")
        raise CollectiveMismatchError(message)

    # -- reductions ----------------------------------------------------------------------
    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                  inplace: bool = False, name: Optional[str] = None) -> Any:
        op = ReduceOp.parse(op)
        with _labelled(self._enter("allreduce", tensor, name=name, op=op.value)):
            return self._inner.allreduce(tensor, op, inplace=inplace, name=name)

    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        inplace: bool = False, name: Optional[str] = None) -> Handle:
        op = ReduceOp.parse(op)
        label = self._enter("allreduce", tensor, name=name, op=op.value)
        with _labelled(label):
            return _LabelledHandle(self._inner.allreduce_async(tensor, op, inplace=inplace, name=name), label)

    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                       name: Optional[str] = None) -> Any:
        op = ReduceOp.parse(op)
        with _labelled(self._enter("reduce_scatter", tensor, name=name, op=op.value)):
            return self._inner.reduce_scatter(tensor, op, name=name)

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        op = ReduceOp.parse(op)
        label = self._enter("reduce_scatter", tensor, name=name, op=op.value)
        with _labelled(label):
            return _LabelledHandle(self._inner.reduce_scatter_async(tensor, op, name=name), label)

    def reduce_scatter_in_place_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                                      name: Optional[str] = None) -> Handle:
        op = ReduceOp.parse(op)
        label = self._enter("reduce_scatter", tensor, name=name, op=op.value)
        with _labelled(label):
            return _LabelledHandle(self._inner.reduce_scatter_in_place_async(tensor, op, name=name), label)

    # -- data movement -----------------------------------------------------------------------
    def allgather(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Any:
        with _labelled(self._enter("allgather", tensor, name=name, extra=UNIFORM if uniform else None)):
            return self._inner.allgather(tensor, name=name, uniform=uniform)

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        label = self._enter("allgather", tensor, name=name, extra=UNIFORM if uniform else None)
        with _labelled(label):
            return _LabelledHandle(self._inner.allgather_async(tensor, name=name, uniform=uniform), label)

    def broadcast(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                  name: Optional[str] = None) -> Any:
        with _labelled(self._enter("broadcast", tensor, name=name, root=root)):
            return self._inner.broadcast(tensor, root, inplace=inplace, name=name)

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        label = self._enter("broadcast", tensor, name=name, root=root)
        with _labelled(label):
            return _LabelledHandle(self._inner.broadcast_async(tensor, root, inplace=inplace, name=name), label)

    def alltoall(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                 recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Any:
        with _labelled(self._enter("alltoall", tensor, name=name)):
            return self._inner.alltoall(tensor, splits, recv_splits=recv_splits, name=name)

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
        label = self._enter("alltoall", tensor, name=name)
        with _labelled(label):
            return _LabelledHandle(self._inner.alltoall_async(tensor, splits, recv_splits=recv_splits, name=name), label)

    # -- point to point (unchecked: pairs are explicit) ------------------------------------------
    def send(self, tensor: Any, dest: int, tag: int = 0) -> None:
        self._inner.send(tensor, dest, tag)

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        return self._inner.send_async(tensor, dest, tag)

    def recv(self, tensor: Any, source: int, tag: int = 0) -> Any:
        return self._inner.recv(tensor, source, tag)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        return self._inner.recv_async(tensor, source, tag)

    # -- control -----------------------------------------------------------------------------------
    def barrier(self) -> None:
        with _labelled(self._enter("barrier")):
            self._inner.barrier()

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["CheckedCommunicator"]:
        extra = "split by colour" if ranks is None else f"split ranks {[int(r) for r in ranks]}"
        self._enter("split", extra=extra)
        sub = self._inner.split(color, key, ranks=ranks)
        return None if sub is None else CheckedCommunicator(sub, every=self.every, timeout=self.timeout)

    def duplicate(self) -> "CheckedCommunicator":
        self._enter("duplicate")
        return CheckedCommunicator(self._inner.duplicate(), every=self.every, timeout=self.timeout)

    def thread_safe_duplicate(self) -> Optional[Communicator]:
        """The wrapped communicator's (unchecked: a library's own background traffic, e.g. a checkpoint commit)."""
        self._enter("split", extra="thread_safe_duplicate")
        return self._inner.thread_safe_duplicate()

    def allgather_object(self, obj: Any) -> list[Any]:
        self._enter("allgather_object")
        return self._inner.allgather_object(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._enter("broadcast_object", root=root)
        return self._inner.broadcast_object(obj, root)

    def abort(self, code: int = 1) -> None:
        self._inner.abort(code)

    def free(self) -> None:
        """Check that every rank ends here too (a rank with surplus collectives is named), then free."""
        if self._freed:
            return
        self._freed = True
        self._enter("free")
        self._inner.free()

    def __repr__(self) -> str:
        return f"<CheckedCommunicator every={self.every} timeout={self.timeout} over {self._inner!r}>"
