"""Ring attention over a context-parallel group, with causal load balancing.

Each rank holds the queries, keys and values of its head and tail chunks
(:mod:`shardwise.core.context_plan`). Forward: the key/value block travels once around
the ring (per step one send to the next rank and one receive from the previous, the next
block in flight while this one is attended to); each block gives a partial output and its
log-sum-exp, merged into the running result. Only the rank's own q, k, v, output and
log-sum-exp are kept for backward. Backward: the blocks travel around again, now with
their key/value gradient accumulators, which arrive back at their owner after one more
hop; each block's gradients are recomputed from the saved output and log-sum-exp.

Load balancing gives every block one of three shapes (``c`` = chunk length): the rank's
own block, causal over its ``2c`` rising positions; an earlier rank's block, the whole
query against its head chunk, unmasked; a later rank's block, the query's tail chunk
against the whole block, unmasked.

Grouped-query attention: blocks travel with their key/value heads only, and each group of
query heads sharing a key/value head's position is attended separately, so nothing is repeated.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .....core.comm import Communicator
from .blocks import attend, attend_backward

__all__ = ["ring_attention"]

_TAG_FORWARD, _TAG_BACKWARD = 0x5C1, 0x5C2


class _Exchange:
    """One ring hop: send ``tensor`` to the next rank, receive the previous rank's into a new buffer."""

    def __init__(self, comm: Communicator, tensor: torch.Tensor, tag: int) -> None:
        self.sent = tensor.contiguous()
        self.buffer = torch.empty_like(self.sent)
        nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        self._recv = comm.recv_async(self.buffer, prev, tag)
        self._send = comm.send_async(self.sent, nxt, tag)

    def wait(self) -> torch.Tensor:
        self._send.wait()
        got = self._recv.wait()
        return got if isinstance(got, torch.Tensor) else self.buffer


def _block_shape(source: int, rank: int) -> str:
    return "own" if source == rank else "head" if source < rank else "tail"


def _merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge a block's partial attention into ``out``/``lse`` (views of the running result) in place."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1).to(out.dtype))
    out.add_(block_out.mul_(torch.exp(block_lse - new).unsqueeze(-1).to(block_out.dtype)))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    """Query heads ``i, i+g, i+2g, ...`` (``g`` = query heads per key/value head) attend to key/value heads
    ``0, 1, 2, ...``: each of the ``g`` groups is one call per block, so key/value heads are never repeated."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                scale: float) -> torch.Tensor:
        cp, rank = comm.size, comm.rank
        groups, c = q.shape[1] // k.shape[1], q.shape[2] // 2
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            hop = _Exchange(comm, kv, _TAG_FORWARD + step) if step < cp - 1 else None
            keys, values = kv[0], kv[1]
            shape = _block_shape((rank - step) % cp, rank)
            for i in range(groups):
                qi, oi, li = q[:, i::groups], out[:, i::groups], lse[:, i::groups]
                if shape == "own":
                    o, l = attend(qi, keys, values, True, scale)
                    oi.copy_(o)
                    li.copy_(l)
                elif shape == "head":
                    _merge_into(oi, li, *attend(qi, keys[:, :, :c], values[:, :, :c], False, scale))
                else:
                    _merge_into(oi[:, :, c:], li[:, :, c:], *attend(qi[:, :, c:], keys, values, False, scale))
            del keys, values
            if hop is not None:
                kv = hop.wait()
        del kv
        ctx.comm, ctx.scale = comm, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, scale = ctx.comm, ctx.scale
        cp, rank = comm.size, comm.rank
        groups, c = q.shape[1] // k.shape[1], q.shape[2] // 2
        acc = torch.float32
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        # travelling with each block: its keys, values and the gradients accumulated for them so far
        block = torch.empty((4, *k.shape), dtype=acc, device=k.device)
        block[0].copy_(k)
        block[1].copy_(v)
        block[2:].zero_()
        for step in range(cp):
            keys, values = block[0].to(q.dtype), block[1].to(q.dtype)
            shape = _block_shape((rank - step) % cp, rank)
            for i in range(groups):
                qi, oi, li, di = q[:, i::groups], out[:, i::groups], lse[:, i::groups], dout[:, i::groups]
                if shape == "own":
                    gq, gk, gv = attend_backward(di, qi, keys, values, oi, li, True, scale)
                    dq[:, i::groups] += gq
                    block[2] += gk
                    block[3] += gv
                elif shape == "head":
                    gq, gk, gv = attend_backward(di, qi, keys[:, :, :c], values[:, :, :c], oi, li, False, scale)
                    dq[:, i::groups] += gq
                    block[2][:, :, :c] += gk
                    block[3][:, :, :c] += gv
                else:
                    gq, gk, gv = attend_backward(di[:, :, c:], qi[:, :, c:], keys, values, oi[:, :, c:],
                                                 li[:, :, c:], False, scale)
                    dq[:, i::groups, c:] += gq
                    block[2] += gk
                    block[3] += gv
                del gq, gk, gv
            del keys, values
            if cp > 1:  # the last hop carries only the gradients, home to the block's owner
                block = _Exchange(comm, block if step < cp - 1 else block[2:], _TAG_BACKWARD + step).wait()
        dk, dv = (block[0], block[1]) if cp > 1 else (block[2], block[3])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                   scale: float) -> torch.Tensor:
    """Causal attention of the context-parallel group's sequence, for this rank's head and tail chunks.

    ``q`` is ``[batch, heads, 2c, head_dim]``, ``k`` and ``v`` ``[batch, kv_heads, 2c, head_dim]``
    (``kv_heads`` dividing ``heads``), laid out as :func:`~shardwise.core.context_plan.local_positions`
    says; returns this rank's output, shaped as ``q``. Collective over ``comm``.
    """
    return _RingAttention.apply(q, k, v, comm, scale)
