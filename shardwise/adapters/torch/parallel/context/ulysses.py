"""Ulysses attention (DeepSpeed): an all-to-all turns the sequence split into a head split and back.

Each rank holds the queries, keys and values of its chunks for every head. An all-to-all
over the context-parallel group gives each rank the whole sequence for ``heads / cp`` of
the heads; it sorts the positions (the ranks' head and tail chunks, :mod:`shardwise.core.context_plan`),
runs ordinary causal attention (``scaled_dot_product_attention``, flash on the CPU), and a
second all-to-all returns each rank its chunks for every head. Backward is the same two
exchanges the other way round. Key/value heads are split the same way where ``cp`` divides
them, and repeated to the query heads first where it does not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .....core.comm import Communicator
from .....core.context_plan import check_heads, local_positions
from .blocks import repeat_heads

__all__ = ["ulysses_attention"]


def _seq_to_heads(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``[b, h, s_local, d]`` -> ``[b, h / cp, cp * s_local, d]`` (the ranks' chunks in rank order)."""
    b, h, s, d = x.shape
    cp = comm.size
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
    got = comm.alltoall(send.reshape(cp, -1)).view(cp, b, h // cp, s, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    b, hl, n, d = x.shape
    cp = comm.size
    s = n // cp
    send = x.reshape(b, hl, cp, s, d).permute(2, 0, 1, 3, 4).contiguous()
    got = comm.alltoall(send.reshape(cp, -1)).view(cp, b, hl, s, d)
    return got.transpose(0, 1).reshape(b, cp * hl, s, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _seq_to_heads(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad.contiguous(), ctx.comm), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _heads_to_seq(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad.contiguous(), ctx.comm), None


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
    q, k, v = (_SeqToHeads.apply(t.contiguous(), comm) for t in (q, k, v))
    s_local = q.shape[2] // cp
    order = torch.tensor([p for r in range(cp) for p in local_positions(s_local * cp, cp, r)], device=q.device)
    sort = torch.argsort(order)  # index of each position, in position order, within the gathered sequence
    q, k, v = (t.index_select(2, sort) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, repeat_heads(k, groups), repeat_heads(v, groups), is_causal=True,
                                         scale=scale)
    out = out.index_select(2, order)  # back to the gathered (rank) order: position order[i] sits at i
    return _HeadsToSeq.apply(out.contiguous(), comm)
