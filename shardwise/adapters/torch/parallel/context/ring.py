"""Ring attention over a context-parallel group, with causal load balancing.

Each rank holds the queries, keys and values of its head and tail chunks
(:mod:`shardwise.core.context_plan`). Forward: the key/value block travels once around
the ring (per step one send to the next rank and one receive from the previous, the next
block in flight while this one is attended to); each block gives a partial output and its
log-sum-exp, merged into the running result. Only the rank's own q, k, v, output and
log-sum-exp are kept for backward. Backward: the blocks travel around again, now with
their key/value gradient accumulators (sent on once the next block has arrived), which
arrive back at their owner after one more hop; each block's gradients are recomputed from the saved output and log-sum-exp.

Load balancing makes every pair of chunks (the rank's head or tail chunk against a block's
head or tail chunk) either the same chunk (causal), an earlier one (unmasked) or a later one
(skipped): against its own block a rank computes 3 of the 4 pairs, against any other 2, so
every rank does the same work. Each pair is one kernel call per query head.

Grouped-query attention: blocks travel with their key/value heads only, and each query head
is attended against its key/value head, so nothing is repeated.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .....core.comm import Communicator
from .blocks import attend, attend_backward

__all__ = ["ring_attention"]

_TAG_FORWARD, _TAG_BACKWARD, _TAG_GRADIENTS = 0x5C100, 0x5C200, 0x5C300


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
        self._recv.wait()
        # drop every reference to the sent block (the handles hold views of it) before the next one is made
        buffer, self.sent, self.buffer, self._send, self._recv = self.buffer, None, None, None, None
        return buffer


def _chunk_pairs(rank: int, source: int, cp: int) -> list[tuple[int, int, bool]]:
    """``(query chunk, key chunk, causal)`` of this rank's two chunks against ``source``'s two (0: head,
    1: tail) that attend at all: the same global chunk causally, an earlier one whole, a later one not."""
    mine, theirs = (rank, 2 * cp - 1 - rank), (source, 2 * cp - 1 - source)
    return [(a, b, mine[a] == theirs[b]) for a in (0, 1) for b in (0, 1) if theirs[b] <= mine[a]]


def _merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge a block's partial attention into ``out``/``lse`` (views of the running result) in place."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1).to(out.dtype))
    out.add_(block_out.mul_(torch.exp(block_lse - new).unsqueeze(-1).to(block_out.dtype)))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    """One kernel call per query head and block, against its key/value head (``h // g``, ``g`` query heads per
    key/value head): key/value heads are never repeated, and a call's temporaries are one head's."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                scale: float) -> torch.Tensor:
        cp, rank = comm.size, comm.rank
        groups, c = q.shape[1] // k.shape[1], q.shape[2] // 2
        b, h, n, d = q.shape  # the output laid out [b, s, h, d], as transformers returns it (no copy there)
        out = torch.zeros((b, n, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            hop = _Exchange(comm, kv, _TAG_FORWARD + step) if step < cp - 1 else None
            _forward_block(q, kv, out, lse, _chunk_pairs(rank, (rank - step) % cp, cp), groups, c, scale)
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
        # the blocks travel around again (the next one in flight while this one is worked on); the gradients
        # accumulated for a block follow it once the next block has arrived, and go home after the last
        kv = torch.stack([k, v])
        grads = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        for step in range(cp):
            hop = _Exchange(comm, kv, _TAG_BACKWARD + step) if step < cp - 1 else None
            _backward_block(q, out, lse, dout, dq, kv, grads, _chunk_pairs(rank, (rank - step) % cp, cp), groups,
                            c, scale)
            if hop is not None:
                kv = hop.wait()
            if cp > 1:
                grads = _Exchange(comm, grads, _TAG_GRADIENTS + step).wait()
        del kv
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None


def _forward_block(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   pairs: list[tuple[int, int, bool]], groups: int, c: int, scale: float) -> None:
    """Attend every query head's chunks to the block's chunks they see, merged into ``out``/``lse``: one
    kernel call per head and chunk pair, so a call's temporaries are one head's chunk (the views made here
    die on return, so the block can be freed as soon as the next one has arrived)."""
    for h in range(q.shape[1]):
        j = h // groups
        for a, b, causal in pairs:
            qs, ks = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
            _merge_into(out[:, h:h + 1, qs], lse[:, h:h + 1, qs],
                        *attend(q[:, h:h + 1, qs], kv[0][:, j:j + 1, ks], kv[1][:, j:j + 1, ks], causal, scale))


def _backward_block(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor,
                    kv: torch.Tensor, grads: torch.Tensor, pairs: list[tuple[int, int, bool]], groups: int, c: int,
                    scale: float) -> None:
    """One block's gradients, recomputed per head and chunk pair from the whole attention's output and
    log-sum-exp: into ``dq`` and the block's key/value gradient accumulators ``grads``."""
    for h in range(q.shape[1]):
        j = h // groups
        for a, b, causal in pairs:
            qs, ks = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
            gq, gk, gv = attend_backward(dout[:, h:h + 1, qs], q[:, h:h + 1, qs], kv[0][:, j:j + 1, ks],
                                         kv[1][:, j:j + 1, ks], out[:, h:h + 1, qs], lse[:, h:h + 1, qs], causal,
                                         scale)
            dq[:, h:h + 1, qs] += gq
            grads[0][:, j:j + 1, ks] += gk
            grads[1][:, j:j + 1, ks] += gv
            del gq, gk, gv


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                   scale: float) -> torch.Tensor:
    """Causal attention of the context-parallel group's sequence, for this rank's head and tail chunks.

    ``q`` is ``[batch, heads, 2c, head_dim]``, ``k`` and ``v`` ``[batch, kv_heads, 2c, head_dim]``
    (``kv_heads`` dividing ``heads``), laid out as :func:`~shardwise.core.context_plan.local_positions`
    says; returns this rank's output, shaped as ``q``. Collective over ``comm``.
    """
    return _RingAttention.apply(q, k, v, comm, scale)
