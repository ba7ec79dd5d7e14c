"""Ulysses attention (DeepSpeed): an all-to-all turns the sequence split into a head split and back.

Each rank holds the queries, keys and values of its chunks for every head. An all-to-all
over the context-parallel group gives each rank the whole sequence for ``heads / cp`` of
the heads, put in position order as it is unpacked (the ranks' head and tail chunks,
:mod:`shardwise.core.context_plan`); it runs ordinary causal attention (``scaled_dot_product_attention``, flash on the CPU), and a
second all-to-all returns each rank its chunks for every head. Backward is the same two
exchanges the other way round. Key/value heads are split the same way where ``cp`` divides
them, and repeated to the query heads first where it does not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .....core.comm import Communicator
from .....core.context_plan import check_heads
from .blocks import repeat_heads

__all__ = ["ulysses_attention"]


def _seq_to_heads(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``[b, h, s_local, d]`` (this rank's head and tail chunks) -> ``[b, h / cp, s, d]`` in position order.

    Rank ``r``'s head chunk is chunk ``r`` of the sequence and its tail chunk chunk ``2cp-1-r``, so the
    received heads come first in rank order, then the tails in reverse rank order; one copy puts them there.
    """
    b, h, s, d = x.shape
    cp, c = comm.size, s // 2
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
    got = comm.alltoall(send.reshape(cp, -1)).view(cp, b, h // cp, 2, c, d)
    out = torch.empty((b, h // cp, 2 * cp, c, d), dtype=x.dtype, device=x.device)
    out[:, :, :cp].copy_(got[:, :, :, 0].permute(1, 2, 0, 3, 4))
    out[:, :, cp:].copy_(got[:, :, :, 1].flip(0).permute(1, 2, 0, 3, 4))
    return out.view(b, h // cp, 2 * cp * c, d)


def _heads_to_seq(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    b, hl, n, d = x.shape
    cp = comm.size
    c = n // (2 * cp)
    chunks = x.view(b, hl, 2 * cp, c, d)
    send = torch.empty((cp, b, hl, 2, c, d), dtype=x.dtype, device=x.device)
    send[:, :, :, 0].copy_(chunks[:, :, :cp].permute(2, 0, 1, 3, 4))
    send[:, :, :, 1].copy_(chunks[:, :, cp:].permute(2, 0, 1, 3, 4).flip(0))
    got = comm.alltoall(send.view(cp, -1)).view(cp, b, hl, 2 * c, d)
    out = torch.empty((b, 2 * c, cp * hl, d), dtype=x.dtype, device=x.device)  # [b, s, h, d], as transformers
    out.view(b, 2 * c, cp, hl, d).copy_(got.permute(1, 3, 0, 2, 4))  # returns it: no copy there
    return out.transpose(1, 2)


class _Regroup(torch.autograd.Function):
    """The all-to-all between the sequence split and the head split (``to_heads``), or back; its
    backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, to_heads: bool) -> torch.Tensor:
        ctx.comm, ctx.to_heads = comm, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad.contiguous(), ctx.comm), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                      scale: float) -> torch.Tensor:
    """Causal attention of the context-parallel group's sequence for this rank's chunks, by head split.

    Shapes and layout as :func:`~.ring.ring_attention`; :class:`ConfigError` unless ``cp`` divides the
    query heads. Collective over ``comm``.
    """
    cp = comm.size
    heads, kv_heads = q.shape[1], k.shape[1]
    check_heads(heads, kv_heads, cp)
    if kv_heads % cp:
        k, v = repeat_heads(k, heads // kv_heads), repeat_heads(v, heads // kv_heads)
    groups = q.shape[1] // k.shape[1]
    q, k, v = (_Regroup.apply(t, comm, True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
    return _Regroup.apply(out, comm, False)
