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

Grouped-query attention: blocks travel with their key/value heads and are repeated to
the query heads per block; the repeated heads' gradients are summed back.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .....core.comm import Communicator
from .blocks import attend, attend_backward, merge, repeat_heads, sum_heads

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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                scale: float) -> torch.Tensor:
        cp, rank = comm.size, comm.rank
        groups, c = q.shape[1] // k.shape[1], q.shape[2] // 2
        kv = torch.stack([k, v])
        out: Optional[torch.Tensor] = None
        lse: Optional[torch.Tensor] = None
        for step in range(cp):
            hop = _Exchange(comm, kv, _TAG_FORWARD + step) if step < cp - 1 else None
            keys, values = repeat_heads(kv[0], groups), repeat_heads(kv[1], groups)
            shape = _block_shape((rank - step) % cp, rank)
            if shape == "own":
                out, lse = attend(q, keys, values, True, scale)
                out, lse = out.clone(), lse.clone()
            elif shape == "head":
                o, l = attend(q, keys[:, :, :c].contiguous(), values[:, :, :c].contiguous(), False, scale)
                out, lse = merge(out, lse, o, l)
            else:
                o, l = attend(q[:, :, c:].contiguous(), keys, values, False, scale)
                out[:, :, c:], lse[:, :, c:] = merge(out[:, :, c:], lse[:, :, c:], o, l)
            del keys, values
            if hop is not None:
                kv = hop.wait()
        ctx.comm, ctx.scale = comm, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, scale = ctx.comm, ctx.scale
        cp, rank = comm.size, comm.rank
        groups, c = q.shape[1] // k.shape[1], q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        # travelling with each block: its keys, values and the gradients accumulated for them so far
        block = torch.cat([torch.stack([k, v]).float(), torch.zeros((2, *k.shape), dtype=torch.float32,
                                                                    device=k.device)])
        for step in range(cp):
            keys = repeat_heads(block[0].to(q.dtype), groups)
            values = repeat_heads(block[1].to(q.dtype), groups)
            shape = _block_shape((rank - step) % cp, rank)
            if shape == "own":
                gq, gk, gv = attend_backward(dout, q, keys, values, out, lse, True, scale)
                dq += gq
                block[2] += sum_heads(gk, groups)
                block[3] += sum_heads(gv, groups)
            elif shape == "head":
                gq, gk, gv = attend_backward(dout, q, keys[:, :, :c].contiguous(), values[:, :, :c].contiguous(),
                                             out, lse, False, scale)
                dq += gq
                block[2][:, :, :c] += sum_heads(gk, groups)
                block[3][:, :, :c] += sum_heads(gv, groups)
            else:
                gq, gk, gv = attend_backward(dout[:, :, c:], q[:, :, c:].contiguous(), keys, values,
                                             out[:, :, c:], lse[:, :, c:], False, scale)
                dq[:, :, c:] += gq
                block[2] += sum_heads(gk, groups)
                block[3] += sum_heads(gv, groups)
            del keys, values, gq, gk, gv
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
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), comm, scale)
