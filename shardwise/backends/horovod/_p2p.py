"""send/recv for the ``horovod`` backend: a two-rank alltoall on the pair's process set.

Horovod has no point-to-point operation. The sender's alltoall sends its data to the
receiver and nothing to itself; the receiver's sends nothing. Both name the operation
``p2p.<src>><dst>.t<tag>.<n>`` (the n-th message from src to dst with that tag), so
messages match in order per (source, tag), as in MPI. Horovod makes process sets only
collectively over the whole job, so the pair sets are made once at start-up
(:meth:`Engine.make_pairs`).
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

from ...core.comm import CompletedHandle, Handle
from ...core.errors import ShapeMismatchError
from ._engine import as_torch, from_wire, hvd, publish, to_wire, torch

__all__ = ["PairPointToPoint"]


class PairPointToPoint:
    """Mixin for :class:`~shardwise.backends.horovod.HorovodCommunicator` (uses its members and engine)."""

    def _pair_op(self, flat: Any, peer: int, tag: int, sending: bool) -> tuple[Optional[int], Any]:
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"peer rank {peer} is out of range or this rank (group of size {self._size})")
        me, other = self._members[self._rank], self._members[peer]
        src, dst = (me, other) if sending else (other, me)
        counter = self._p2p.setdefault((src, dst, tag), itertools.count())
        name = f"sw.{self._tag}.p2p.{src}>{dst}.t{tag}.{next(counter)}"
        if flat.numel() == 0:
            return None, flat
        pair = self._engine.pair(me, other)
        n = flat.numel() if sending else 0
        send_rows = [0, n] if me < other else [n, 0]
        payload = flat if sending else flat[:0]
        h = hvd.alltoall_async(payload, splits=torch.tensor(send_rows, dtype=torch.int32), name=name,
                               process_set=pair)
        return h, payload

    def _pair_wire(self, tensor: Any, peer: int, tag: int, sending: bool) -> tuple:
        """``tensor`` as torch (and whether it was numpy), and the pair operation on its wire form."""
        t, was_np = as_torch(tensor)
        h, keep = self._pair_op(to_wire(t, reduce=False).reshape(-1), peer, tag, sending=sending)
        return t, was_np, h, keep

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        _, _, h, keep = self._pair_wire(tensor, dest, tag, sending=True)
        if h is None:
            return CompletedHandle(None)
        return self._handle(f"send to rank {dest}", [h], lambda outs: None, keepalive=keep)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        t, was_np, h, keep = self._pair_wire(tensor, source, tag, sending=False)
        if h is None:
            return CompletedHandle(tensor)

        def finish(outs: list) -> Any:
            got = outs[0][0]
            if got.numel() != t.numel():
                raise ShapeMismatchError(f"recv from rank {source}: got {got.numel()} elements, "
                                         f"the buffer holds {t.numel()}")
            return publish(tensor, t, from_wire(got, t).reshape(t.shape), was_np)

        return self._handle(f"recv from rank {source}", [h], finish, keepalive=keep)
