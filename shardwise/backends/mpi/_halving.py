"""Large averages on the ``mpi`` backend as recursive halving, then recursive doubling.

In a power-of-two group, a reduce-scatter by recursive halving followed by an
allgather by recursive doubling (Rabenseifner's allreduce, which MPICH runs for long
messages) moves the same bytes as Open MPI's shared-memory allreduce, but each rank
sums only the block it owns and divides it there, while it is still in cache: one
pass over ``1/n`` of the data instead of a division over the whole buffer once the
allreduce has returned. For sums it gains nothing, so sums stay with ``Allreduce``.
On 2 ranks of this project's machine, averaging 46 MB of float32 gradients (four
tensors, 4 MiB pieces) took 11.2 ms against 15.1 ms for ``Allreduce`` plus the
division; from 2 MiB up a single average is quicker (4 MiB: 0.92 against 1.10 ms).

The messages travel on a duplicate of the communicator, so they never match a
user's point-to-point messages on the original one. Each block is summed by one
rank and sent to the others, so every rank ends with identical bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...core.comm import ReduceOp

__all__ = ["HALVING_MIN_BYTES", "halving_group", "halving_applies", "halving_scratch", "halving_allreduce"]

#: Smallest buffer averaged by halving; below it ``Allreduce`` plus the division is as quick.
HALVING_MIN_BYTES = 1 << 20

_TAG = 7


def halving_group(size: int) -> bool:
    """True for a group that halving can serve: a power of two, 2 or more."""
    return size >= 2 and size & (size - 1) == 0


def halving_applies(array: np.ndarray, op: ReduceOp) -> bool:
    """True for an average of at least :data:`HALVING_MIN_BYTES` of floats (in a :func:`halving_group`)."""
    return op is ReduceOp.AVERAGE and array.dtype.kind == "f" and array.nbytes >= HALVING_MIN_BYTES


def halving_scratch(numel: int, dtype: np.dtype) -> np.ndarray:
    """The receive buffer :func:`halving_allreduce` needs for pieces of up to ``numel`` elements."""
    return np.empty((numel + 1) // 2, dtype)


def halving_allreduce(comm: Any, flat: np.ndarray, scratch: np.ndarray) -> None:
    """Average the contiguous 1-D ``flat`` across the mpi4py ``comm`` in place; blocking.

    ``scratch`` (:func:`halving_scratch`) holds what a partner sends; one serves every piece.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    lo, hi = 0, flat.size
    steps: list[tuple[int, int, int, int, int]] = []  # (partner, kept lo, kept hi, given lo, given hi)
    mask = size >> 1
    while mask:
        partner = rank ^ mask
        mid = lo + (hi - lo) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & mask else ((lo, mid), (mid, hi))
        got = scratch[:keep[1] - keep[0]]
        comm.Sendrecv(flat[give[0]:give[1]], partner, _TAG, got, partner, _TAG)
        mine = flat[keep[0]:keep[1]]
        np.add(mine, got, out=mine)
        steps.append((partner, keep[0], keep[1], give[0], give[1]))
        lo, hi = keep
        mask >>= 1
    owned = flat[lo:hi]
    np.divide(owned, size, out=owned)
    for partner, keep_lo, keep_hi, give_lo, give_hi in reversed(steps):
        comm.Sendrecv(flat[keep_lo:keep_hi], partner, _TAG, flat[give_lo:give_hi], partner, _TAG)
