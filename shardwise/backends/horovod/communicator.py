"""The ``horovod`` backend: collectives on Horovod's engine through ``horovod.torch``.

torch tensors go to Horovod as they are (CPU; bfloat16, which Horovod lacks, is
reduced in float32 and moved as raw bits); numpy arrays are wrapped with
``torch.from_numpy`` and come back as numpy. Sub-groups are Horovod process sets;
averaging is a Horovod sum divided locally (floor division for integers), as on
the other backends. Every operation gets a name unique on this communicator
(Horovod matches operations across ranks by name); a caller's ``name`` is kept
(prefixed), so Horovod's response cache works for names reused step after step.

send/recv: Horovod has no point-to-point operation. They run as an alltoall on the
two-rank process set of sender and receiver (the receiver sends nothing). Horovod
creates process sets only collectively over the whole job, so those pair sets are
made once at start-up, for jobs of up to ``SHARDWISE_HOROVOD_P2P_MAX`` ranks
(default 16); above that send/recv raise :class:`NotImplementedError`.
"""

from __future__ import annotations

import itertools
import os
import pickle
from typing import Any, Callable, Optional, Sequence

from ...core.comm import CompletedHandle, Communicator, Handle, ReduceOp, split_sizes
from ...core.errors import ShapeMismatchError
from .._arrays import alltoall_rows
from ._engine import (Engine, HorovodHandle, ThenHandle, as_torch, divide, from_wire, hvd, p2p_max, publish, to_wire,
                      torch)
from ._p2p import PairPointToPoint
from .._rank_order import to_engine_order, to_our_order
from .._group import GroupMember, split_groups, split_members

__all__ = ["HorovodCommunicator"]

_HVD_OPS = {ReduceOp.SUM: hvd.Sum, ReduceOp.AVERAGE: hvd.Sum, ReduceOp.MIN: hvd.Min,
            ReduceOp.MAX: hvd.Max, ReduceOp.PRODUCT: hvd.Product}


class HorovodCommunicator(PairPointToPoint, GroupMember, Communicator):
    """A :class:`Communicator` over a Horovod process set (the global one by default)."""

    backend = "horovod"

    def __init__(self, *, timeout: Optional[float] = None, _engine: Optional[Engine] = None,
                 _members: Optional[Sequence[int]] = None, _tag: str = "w") -> None:
        self._engine = _engine or Engine()
        self._members = list(_members) if _members is not None else list(range(self._engine.size))
        self._rank = self._members.index(self._engine.rank)
        self._size = len(self._members)
        self._set = self._engine.process_set(self._members) if self._size > 1 else None
        by_set = sorted(self._members)
        order = [by_set.index(g) for g in self._members]  # our rank i is set rank order[i]
        self._order = None if order == list(range(self._size)) else order
        self._tag, self._seq, self._splits = _tag, itertools.count(), itertools.count()
        self._p2p: dict[tuple[int, int, int], itertools.count] = {}
        self.timeout = timeout
        if _engine is None and 1 < self._size <= p2p_max():
            self._engine.make_pairs()

    @property
    def process_set(self) -> Any:
        """The Horovod process set of this group (``None`` for a single rank)."""
        return self._set

    # -- plumbing ---------------------------------------------------------------------
    def _name(self, kind: str, name: Optional[str]) -> str:
        return f"sw.{self._tag}.{kind}.{name}" if name else f"sw.{self._tag}.{kind}#{next(self._seq)}"

    def _handle(self, what: str, handles: list[int], finish: Callable[[list[Any]], Any],
                keepalive: Any = None) -> Handle:
        return HorovodHandle(what, handles, finish, self.timeout, keepalive)

    def _by_set(self, blocks: list) -> list:
        """Per-rank blocks from our rank order to process-set order."""
        return to_engine_order(blocks, self._order)

    def _by_ours(self, blocks: list) -> list:
        """Per-rank blocks from process-set order to our rank order."""
        return to_our_order(blocks, self._order)

    # -- reductions ---------------------------------------------------------------------
    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        inplace: bool = False, name: Optional[str] = None) -> Handle:
        op = ReduceOp.parse(op)
        t, was_np = as_torch(tensor)
        # Horovod reduces float16 natively only for sums.
        upcast = t.dtype == torch.float16 and op not in (ReduceOp.SUM, ReduceOp.AVERAGE)
        wire = to_wire(t.float() if upcast else t, reduce=True)
        if wire.data_ptr() == t.data_ptr() and not (inplace and t.is_contiguous()):
            wire = wire.clone()
        back = (lambda w: publish(tensor, t, from_wire(w, t), was_np)) if inplace else \
            (lambda w: (lambda r: r.numpy() if was_np else r)(from_wire(w, t)))
        if self._size == 1 or wire.numel() == 0:
            return CompletedHandle(back(wire))
        h = hvd.allreduce_async_(wire, name=self._name("allreduce", name), op=_HVD_OPS[op],
                                 process_set=self._set)

        def finish(outs: list) -> Any:
            return back(divide(outs[0], self._size) if op is ReduceOp.AVERAGE else outs[0])

        return self._handle("allreduce", [h], finish, keepalive=wire)

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        op = ReduceOp.parse(op)
        t, was_np = as_torch(tensor)
        if t.dim() == 0:
            raise ShapeMismatchError("reduce_scatter needs a tensor with at least one dimension")
        rows = split_sizes(t.shape[0], self._size)
        start = sum(rows[: self._rank])

        def mine(full: Any) -> Any:
            r = from_wire(full, t).contiguous()
            return r.numpy() if was_np else r

        if self._size == 1 or t.numel() == 0 or op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            # Horovod's reducescatter sums only: other ops reduce everything, then keep our rows.
            inner = self.allreduce_async(t, op, name=name)
            return ThenHandle(inner, lambda full: mine(to_wire(full[start:start + rows[self._rank]], True)))
        wire = to_wire(t, reduce=True)
        most = max(rows)
        if self._order and min(rows) != most:
            # Horovod hands rows out by process-set rank: pad every block to the same length.
            blocks = self._by_set([wire[sum(rows[:i]):sum(rows[:i + 1])] for i in range(self._size)])
            padded = wire.new_zeros((most * self._size,) + tuple(wire.shape[1:]))
            for g, block in enumerate(blocks):
                padded[g * most: g * most + block.shape[0]] = block
            wire = padded
        elif self._order:
            wire = torch.cat(self._by_set(list(torch.split(wire, rows))))
        h = hvd.reducescatter_async(wire, name=self._name("reduce_scatter", name), op=hvd.Sum,
                                    process_set=self._set)

        def finish(outs: list) -> Any:
            out = outs[0][: rows[self._rank]]
            return mine(divide(out, self._size) if op is ReduceOp.AVERAGE else out)

        return self._handle("reduce_scatter", [h], finish, keepalive=wire)

    # -- data movement --------------------------------------------------------------------
    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        t, was_np = as_torch(tensor)
        if t.dim() == 0:
            t = t.reshape(1)
        wire = to_wire(t, reduce=False)
        if self._size == 1:
            return CompletedHandle((lambda r: r.numpy() if was_np else r)(from_wire(wire.clone(), t)))
        rows = None
        if self._order and uniform:
            rows = [t.shape[0]] * self._size
        elif self._order:  # Horovod concatenates in process-set order: learn each rank's rows first
            counts = hvd.allgather(torch.tensor([t.shape[0]], dtype=torch.int64),
                                   name=self._name("allgather_rows", None), process_set=self._set)
            rows = counts.tolist()
        h = hvd.allgather_async(wire, name=self._name("allgather", name), process_set=self._set)

        def finish(outs: list) -> Any:
            out = outs[0]
            if rows is not None:
                out = torch.cat(self._by_ours(list(torch.split(out, rows))))
            r = from_wire(out, t)
            return r.numpy() if was_np else r

        return self._handle("allgather", [h], finish, keepalive=wire)

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        if not 0 <= root < self._size:
            raise ValueError(f"root {root} is out of range for a group of size {self._size}")
        t, was_np = as_torch(tensor)
        wire = to_wire(t, reduce=False)
        if wire.data_ptr() == t.data_ptr() and not inplace:
            wire = wire.clone()

        def back(w: Any) -> Any:
            if inplace:
                return publish(tensor, t, from_wire(w, t), was_np)
            r = from_wire(w, t)
            return r.numpy() if was_np else r

        if self._size == 1 or wire.numel() == 0:
            return CompletedHandle(back(wire))
        # Horovod names the root by its global rank, even within a process set.
        h = hvd.broadcast_async_(wire, self._members[root], name=self._name("broadcast", name),
                                 process_set=self._set)
        return self._handle("broadcast", [h], lambda outs: back(outs[0]), keepalive=wire)

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
        t, was_np = as_torch(tensor)
        send_rows = alltoall_rows(tuple(t.shape), splits, self._size)
        wire = to_wire(t, reduce=False)
        if self._size == 1:
            return CompletedHandle((lambda r: r.numpy() if was_np else r)(from_wire(wire.clone(), t)))
        if self._order:
            wire = torch.cat(self._by_set(list(torch.split(wire, send_rows))))
            send_rows = self._by_set(send_rows)
        h = hvd.alltoall_async(wire, splits=torch.tensor(send_rows, dtype=torch.int32),
                               name=self._name("alltoall", name), process_set=self._set)

        def finish(outs: list) -> Any:
            out, received = outs[0]
            if self._order:
                out = torch.cat(self._by_ours(list(torch.split(out, received.tolist()))))
            r = from_wire(out, t)
            return r.numpy() if was_np else r

        return self._handle("alltoall", [h], finish, keepalive=wire)

    # -- control -------------------------------------------------------------------------------
    def barrier(self) -> None:
        if self._size > 1:
            self.allreduce(torch.zeros(1, dtype=torch.int32), name=None)

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["HorovodCommunicator"]:
        if (color is None) == (ranks is None):
            split_members(self._size, color, ranks)  # raises the error every backend gives
        if self._size != self._engine.size:
            raise NotImplementedError(
                "the horovod backend splits only the world communicator: Horovod creates process sets "
                "collectively over every process of the job, and ranks outside this group cannot join. "
                "Split the world with the colour or ranks you need instead.")
        groups = split_groups(self, color, key, ranks)
        serial, mine = next(self._splits), None
        for c in sorted(groups):  # every rank creates every group's process set, in the same order
            glob = [self._members[r] for r in groups[c]]
            if self._rank in groups[c]:
                mine = HorovodCommunicator(timeout=self.timeout, _engine=self._engine, _members=glob,
                                           _tag=f"{self._tag}.{serial}.{c}")
            elif len(glob) > 1:
                self._engine.process_set(glob)
        return mine

    def allgather_object(self, obj: Any) -> list[Any]:
        if self._size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        lengths = self.allgather(torch.tensor([data.numel()], dtype=torch.int64)).tolist()
        every = self.allgather(data)
        return [pickle.loads(bytes(p.numpy())) for p in torch.split(every, lengths)]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        if self._size == 1:
            return obj
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self._rank == root \
            else torch.empty(0, dtype=torch.uint8)
        length = self.broadcast(torch.tensor([data.numel()], dtype=torch.int64), root)
        if self._rank != root:
            data = torch.empty(int(length[0]), dtype=torch.uint8)
        return pickle.loads(bytes(self.broadcast(data, root).numpy()))

    def abort(self, code: int = 1) -> None:
        import sys

        sys.stderr.flush()
        if hvd.mpi_enabled():
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(code)
        os._exit(code)

