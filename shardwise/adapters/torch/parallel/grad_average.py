"""Gradients averaged over a group of ranks, in place, one fused all-reduce per dtype."""

from __future__ import annotations

from typing import Iterable

import torch

from ....core.comm import Communicator

__all__ = ["average_gradients"]


def average_gradients(params: Iterable[torch.nn.Parameter], comm: Communicator) -> None:
    """Average the ``.grad`` of ``params`` over ``comm`` in place (one fused allreduce).

    Parameters without a gradient are skipped; every rank must pass the same
    parameters with the same gradient presence, in the same order.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if comm.size == 1 or not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = torch.cat([g.reshape(-1) for g in group])
        flat = comm.allreduce(flat, "average", inplace=True)
        offset = 0
        for g in group:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
