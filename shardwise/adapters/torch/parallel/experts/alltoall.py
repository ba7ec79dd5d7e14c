"""The token exchange of expert parallelism: a differentiable all-to-all with variable splits.

:func:`dispatch` sends each (token, expert) pair of this rank to the rank owning the
expert and says which of that rank's experts each received row is for;
:func:`combine` sends the experts' outputs back, in the original (token, slot)
order, weights them by the routing weights and sums over the slots. Backward mirrors
both: the gradient of each exchange is the exchange with the splits reversed. Every
rank of the group takes part in every exchange, also with no rows to send or receive.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .....core.comm import Communicator

__all__ = ["all_to_all", "dispatch", "combine", "Routing"]


class _AllToAll(torch.autograd.Function):
    """Rows ``[sum(send), ...]`` out in blocks of ``send``, ``[sum(recv), ...]`` in; backward reversed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.comm, ctx.send, ctx.recv = comm, send, recv
        out = comm.alltoall(x.contiguous(), send)
        return out.to(x.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        back = ctx.comm.alltoall(grad.contiguous(), ctx.recv)
        return back.to(grad.device), None, None, None


def all_to_all(x: torch.Tensor, comm: Communicator, send: list[int], recv: list[int]) -> torch.Tensor:
    """Send ``send[i]`` rows of ``x`` (in order) to rank ``i``; receive ``recv[i]`` rows from rank ``i``.

    Differentiable: the gradient goes back with the splits reversed.
    """
    return _AllToAll.apply(x, comm, list(send), list(recv))


class Routing(NamedTuple):
    """What :func:`combine` needs of a :func:`dispatch`."""

    order: torch.Tensor
    """The (token, slot) pairs, flattened, in the order they were sent (sorted by expert)."""
    send: list[int]
    recv: list[int]
    shape: tuple[int, int]
    """``(tokens, top_k)`` of this rank's routing."""


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, comm: Communicator,
             num_local: int) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """This rank's ``[tokens, hidden]`` rows to the owners of their ``[tokens, k]`` experts.

    Returns the rows this rank's experts run on (grouped by sender, then by local
    expert), their local expert ids (``[rows, 1]``) and the :class:`Routing` to send
    the results back. Expert ``e`` belongs to rank ``e // num_local``.
    """
    tokens, k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)  # by expert, so by owning rank
    counts = torch.bincount(ids, minlength=num_local * comm.size).to(torch.int64).cpu()
    got = comm.alltoall(counts, [num_local] * comm.size)  # per sender, per local expert
    got = torch.as_tensor(got, dtype=torch.int64).reshape(comm.size, num_local)
    send = counts.reshape(comm.size, num_local).sum(dim=1).tolist()
    recv = got.sum(dim=1).tolist()
    rows = all_to_all(hidden[order // k], comm, send, recv)
    local = torch.arange(num_local, dtype=torch.int64).repeat(comm.size).repeat_interleave(got.reshape(-1))
    return rows, local.to(hidden.device).unsqueeze(-1), Routing(order, send, recv, (tokens, k))


def combine(out: torch.Tensor, weights: torch.Tensor, routing: Routing, comm: Communicator) -> torch.Tensor:
    """The experts' ``out`` rows back to their senders, weighted by ``weights`` ``[tokens, k]`` and summed
    over the k slots, as Hugging Face's experts forward does (``[tokens, hidden]``)."""
    back = all_to_all(out, comm, routing.recv, routing.send)
    inverse = torch.argsort(routing.order)
    tokens, k = routing.shape
    per_slot = back[inverse].view(tokens, k, back.shape[-1])
    return (per_slot * weights.unsqueeze(-1)).sum(dim=1)
