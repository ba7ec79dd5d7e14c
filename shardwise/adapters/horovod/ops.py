"""Horovod's reduction-op names and its ``op``/``average`` argument rule, shared by every framework module."""

from __future__ import annotations

from typing import Optional, Union

from shardwise.core.comm import ReduceOp

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "OpLike", "resolve_op"]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
#: Horovod's Adasum reduction (scale-invariant adaptive summation of gradients).
Adasum = "adasum"

OpLike = Union[ReduceOp, str]


def resolve_op(op: Optional[OpLike], average: Optional[bool] = None,
               default: ReduceOp = Average) -> Union[ReduceOp, str]:
    """Horovod's ``op``/deprecated ``average`` arguments as a :class:`ReduceOp` or :data:`Adasum`."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return default
    if isinstance(op, str) and op.strip().lower() == Adasum:
        return Adasum
    return ReduceOp.parse(op)
