"""The ``torch`` backend: collectives on ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

numpy arrays are wrapped with ``torch.from_numpy`` (shared memory) and returned as
numpy; torch tensors come back as torch tensors on their own device.

The communicator is assembled from mixins, one job each: :mod:`._plumbing`
(numpy/torch conversion, rank order), :mod:`._reductions` (allreduce,
reduce-scatter), :mod:`._movement` (allgather, broadcast, alltoall) and
:mod:`._torch_p2p` (send, recv), with handles and the int16 widening in
:mod:`._handles`; this module holds the communicator itself and its control
calls (barrier, split, object collectives, abort).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ...core.comm import CompletedHandle, Communicator, Handle, ReduceOp, split_sizes  # noqa: F401
from ...core.errors import (BackendError, CollectiveTimeoutError, ShapeMismatchError, WorkerLostError,  # noqa: F401
                           is_peer_loss)
from .._arrays import check_first_dim_split  # noqa: F401
from .._group import GroupMember, split_groups

try:
    import torch  # noqa: F401
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover
    raise BackendError("the 'torch' backend needs PyTorch: pip install torch") from exc

# Names this module held before the split stay importable from it.
from ._handles import _WIDER, _NarrowedHandle, _WorkHandle, _widened  # noqa: E402,F401
from ._movement import TorchMovement  # noqa: E402
from ._p2p import TorchPointToPoint  # noqa: E402
from ._plumbing import TorchPlumbing  # noqa: E402
from ._reductions import _TORCH_OPS, TorchReductions  # noqa: E402,F401
from ._subgroups import member_group  # noqa: E402


class TorchCommunicator(TorchReductions, TorchMovement, TorchPointToPoint, TorchPlumbing, GroupMember,
                        Communicator):
    """A :class:`Communicator` over a ``torch.distributed`` process group."""

    backend = "torch"

    def __init__(self, group: Optional[Any] = None, *, timeout: Optional[float] = None,
                 order: Optional[Sequence[int]] = None) -> None:
        if not dist.is_initialized():
            raise BackendError("torch.distributed is not initialised; call shardwise.init(backend='torch')")
        self._pg: Optional[Any] = group if group is not None else dist.group.WORLD
        self._size = dist.get_world_size(self._pg)
        # torch orders group members by global rank; ``order[i]`` is the torch group rank of
        # our rank ``i`` so that split() can honour any member order, as MPI does.
        self._order = list(order) if order is not None and list(order) != list(range(self._size)) else None
        group_rank = dist.get_rank(self._group)
        self._rank = self._order.index(group_rank) if self._order else group_rank
        self.timeout = timeout

    @property
    def _group(self) -> Any:
        if self._pg is None:
            raise BackendError("this torch communicator was freed (shardwise.shutdown() or free()); "
                               "call shardwise.init() again and use its communicators")
        return self._pg

    @property
    def process_group(self) -> Any:
        """The underlying ``torch.distributed`` group."""
        return self._group

    def free(self) -> None:
        """Drop this communicator's reference to its process group.

        Once torch's own references go too (``destroy_process_group``), the group's
        worker threads are joined at once. A thread still alive when the interpreter
        finalises, releasing a Python tensor of a finished work, aborts the process
        ("terminate called without an active exception").
        """
        self._pg = None

    # -- control ----------------------------------------------------------------------------------------
    def barrier(self) -> None:
        if self._size > 1:
            work = dist.barrier(group=self._group, async_op=True)
            _WorkHandle("barrier", [work], lambda: None, self.timeout).wait()

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["TorchCommunicator"]:
        groups = split_groups(self, color, key, ranks)
        if self._size != dist.get_world_size():  # a sub-group: its ranks alone make the groups
            mine = next((m for m in groups.values() if self._rank in m), None)
            pg = member_group([self._global(r) for r in mine] if mine else None, self.allgather_object)
            return None if mine is None else self._over(pg, [self._global(r) for r in mine])
        mine = None
        # Every rank of the job creates every group, in the same order.
        for c in sorted(groups):
            members = groups[c]
            global_ranks = [self._global(r) for r in members]
            pg = dist.new_group(global_ranks)
            if self._rank in members:
                mine = self._over(pg, global_ranks)
        return mine

    def duplicate(self) -> "TorchCommunicator":
        """A new process group over this group's ranks, with connections of its own.

        A group spanning the job is made with every rank; a sub-group's duplicate by its
        members alone (:func:`~shardwise.backends.torch._subgroups.member_group`).
        """
        if self._size == 1:
            return self
        global_ranks = [self._global(r) for r in range(self._size)]
        if self._size != dist.get_world_size():
            return self._over(member_group(global_ranks, self.allgather_object), global_ranks)
        return self._over(dist.new_group(sorted(global_ranks)), global_ranks)

    def thread_safe_duplicate(self) -> Optional["TorchCommunicator"]:
        """Collective: a gloo group over this group's ranks, for a second thread (e.g. a background
        checkpoint commit) to call while training calls this one.

        torch's process groups each have connections and a work queue of their own, so calls on two
        groups from two threads do not interleave (torchtitan's async checkpoint runs DCP on such a
        group); gloo moves host objects, so the calling thread's CUDA device does not matter. A
        group spanning the job gets ``new_group(backend="gloo")``; a sub-group is duplicated by its
        members alone when it is gloo already, and gets ``None`` otherwise (torch makes a
        member-only group with the default backends).
        """
        global_ranks = [self._global(r) for r in range(self._size)]
        if self._size != dist.get_world_size():
            return self.duplicate() if str(dist.get_backend(self._group)) == "gloo" and self._size > 1 else None
        return self._over(dist.new_group(sorted(global_ranks), backend="gloo"), global_ranks)

    def _over(self, pg: Any, global_ranks: Sequence[int]) -> "TorchCommunicator":
        """A communicator on ``pg`` whose ranks follow ``global_ranks`` (torch numbers them by global rank)."""
        by_torch = sorted(global_ranks)
        return TorchCommunicator(pg, timeout=self.timeout, order=[by_torch.index(g) for g in global_ranks])

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self._group)
        return self._by_our_rank(out)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(root), group=self._group)
        return box[0]

    def abort(self, code: int = 1) -> None:
        import os
        import sys

        sys.stderr.flush()
        os._exit(code)
