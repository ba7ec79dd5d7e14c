"""Per-rank blocks between shardwise's rank order and an engine's group order.

A sub-communicator's ranks are ordered by world rank; an engine group (a torch
process group, a Horovod process set) may number them differently. ``order[i]`` is
the engine rank of our rank ``i``; an empty ``order`` means the two agree.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["to_engine_order", "to_our_order"]


def to_engine_order(blocks: list, order: Sequence[int]) -> list:
    """Blocks indexed by our rank, reordered to be indexed by engine rank."""
    if not order:
        return blocks
    out = [None] * len(blocks)
    for i, g in enumerate(order):
        out[g] = blocks[i]
    return out


def to_our_order(blocks: list, order: Sequence[int]) -> list:
    """Blocks indexed by engine rank, reordered to be indexed by our rank."""
    return [blocks[g] for g in order] if order else blocks
