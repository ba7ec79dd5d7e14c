"""Host-side pieces of reductions that engines do not do themselves."""

from __future__ import annotations

import numpy as np

from ..core.comm import ReduceOp
from ._arrays import BFLOAT16, bf16_bits_to_f32, f32_to_bf16_bits

#: dtypes summed at a wider precision because MPI has no native type for them.
UPCAST = {"float16", BFLOAT16}


def to_work(arr: np.ndarray, logical: str) -> np.ndarray:
    """A float32 working copy of a half-precision host array."""
    if logical == BFLOAT16:
        return bf16_bits_to_f32(arr.reshape(-1)).reshape(arr.shape)
    return arr.astype(np.float32)


def from_work(work: np.ndarray, logical: str, out: np.ndarray) -> None:
    """Write a float32 working array back into ``out`` at its own precision."""
    if logical == BFLOAT16:
        f32_to_bf16_bits(work, out=out)
    else:
        np.copyto(out, work, casting="unsafe")


def divide(arr: np.ndarray, size: int) -> None:
    """In-place average over ``size`` ranks (floor division for integers)."""
    if arr.dtype.kind in "fc":
        arr /= size
    elif arr.dtype.kind in "iu":
        arr //= size
    else:
        raise TypeError(f"cannot average tensors of dtype {arr.dtype}")


def engine_op(op: ReduceOp) -> ReduceOp:
    """The op the engine runs: averaging is a sum followed by :func:`divide`."""
    return ReduceOp.SUM if op is ReduceOp.AVERAGE else op
