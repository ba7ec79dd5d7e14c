"""Horovod's Adasum reduction of a 1-D float array over a communicator, on the CPU.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation",
MLSys 2021) combines two gradients ``a`` and ``b`` as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 when its squared norm is below ``sqrt(DBL_MIN)``): orthogonal
gradients add, identical ones are not doubled. Over ``2^k`` ranks the result is the
binary tree ``((r0 + r1) + (r2 + r3)) + ...`` of that operation, rank order fixed.

The algorithm is Horovod's (``horovod/common/ops/adasum/adasum.h``,
``FusedAllreduce`` and ``FusedPairwiseReduceWithComm``): vector halving, distance
doubling. At level ``L = 1, 2, 4, ...`` a rank swaps half of the slice it holds with
rank ``rank ^ L`` (the lower rank keeps the first half), so each group of ``2L``
ranks holds its two sub-groups' vectors spread over its members; the dot product and
both squared norms are partial sums over those slices, summed over the group, and
each rank combines its slice with them. Then the slices travel back, doubling each
level, until every rank has the whole result. Horovod sums the partial sums with an
``MPI_Allreduce`` on one sub-communicator per level; here they go point to point by
recursive doubling inside the group (no ``split`` per call), adding the lower rank's
term first so every member gets bitwise the same coefficients.

As in Horovod's Python layer the number of ranks must be a power of two. Unlike
Horovod (which combines float32 data in float32, with float64 dot products), the
data is combined in float64 and cast back to the input dtype at the end.
"""

from __future__ import annotations

import sys

import numpy as np

from .comm import Communicator
from .errors import ConfigError, ShapeMismatchError

__all__ = ["ADASUM_TAG", "adasum_allreduce", "adasum_pair"]

#: Message tag of Adasum's point-to-point traffic (``ADASUM_TAG + 1`` carries the
#: partial dot products and norms); below 32767, MPI's smallest allowed tag bound.
ADASUM_TAG = 31_400

#: Horovod's cut-off: a squared norm below ``sqrt(DBL_MIN)`` counts as zero.
_TINY_NORMSQ = float(np.sqrt(sys.float_info.min))


def _coefficients(dot: float, anormsq: float, bnormsq: float) -> tuple[float, float]:
    """The scales of ``a`` and ``b`` in ``adasum(a, b)``, from ``a.b``, ``|a|^2`` and ``|b|^2``."""
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= _TINY_NORMSQ else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= _TINY_NORMSQ else 1.0
    return acoeff, bcoeff


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``adasum(a, b)`` of two same-shaped arrays, in float64 (single process)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a64.shape != b64.shape:
        raise ShapeMismatchError(f"adasum_pair needs equal shapes, got {a64.shape} and {b64.shape}")
    acoeff, bcoeff = _coefficients(float(np.vdot(a64, b64)), float(np.vdot(a64, a64)),
                                   float(np.vdot(b64, b64)))
    return acoeff * a64 + bcoeff * b64


def _sendrecv(comm: Communicator, send: np.ndarray, recv: np.ndarray, peer: int, tag: int) -> None:
    """Exchange with ``peer`` without deadlocking on large messages (both sides call it)."""
    handle = comm.send_async(send, peer, tag) if send.size else None
    if recv.size:
        comm.recv(recv, peer, tag)
    if handle is not None:
        handle.wait()


def _group_sum(comm: Communicator, terms: np.ndarray, group_size: int, tag: int) -> np.ndarray:
    """Sum ``terms`` over the aligned block of ``group_size`` ranks holding this rank.

    Recursive doubling; every addition puts the lower rank's partial sum first, so all
    members of the block end with bitwise equal sums.
    """
    total = terms.copy()
    other = np.empty_like(total)
    distance = 1
    while distance < group_size:
        peer = comm.rank ^ distance
        _sendrecv(comm, total, other, peer, tag)
        total = other + total if peer < comm.rank else total + other
        distance <<= 1
    return total


def adasum_allreduce(comm: Communicator, array: np.ndarray, *, tag: int = ADASUM_TAG) -> np.ndarray:
    """Adasum of every rank's 1-D float array (same shape on every rank), returned on every rank.

    Every rank of ``comm`` must call it with an array of the same length and dtype.
    ``tag`` and ``tag + 1`` are the point-to-point tags used; concurrent reductions on
    one communicator need distinct tags. Raises :class:`~shardwise.core.errors.ConfigError`
    (a ``ValueError``) when ``comm.size`` is not a power of two.
    """
    array = np.asarray(array)
    if array.ndim != 1:
        raise ShapeMismatchError(f"adasum_allreduce takes a 1-D array, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.floating):
        raise ShapeMismatchError(f"adasum_allreduce reduces floating-point arrays only, got {array.dtype}")
    size, rank = comm.size, comm.rank
    if size & (size - 1):
        raise ConfigError(f"Adasum needs a power-of-two number of ranks, got {size} "
                          f"(as in Horovod; the nearest are {1 << (size.bit_length() - 1)} "
                          f"and {1 << size.bit_length()})")
    if size == 1:
        return array.copy()

    buf = array.astype(np.float64)  # always a fresh, contiguous copy
    lo, hi = 0, buf.size             # the slice [lo, hi) this rank holds
    given: list[tuple[int, int]] = []  # per level, the slice handed to the neighbour

    # Reduce-scatter: halve the held slice each level and Adasum it with the neighbour's.
    level = 1
    while level < size:
        peer = rank ^ level
        mid = lo + (hi - lo) // 2
        is_left = not rank & level
        keep, give = ((lo, mid), (mid, hi)) if is_left else ((mid, hi), (lo, mid))
        mine = buf[keep[0]:keep[1]]
        theirs = np.empty_like(mine)
        _sendrecv(comm, buf[give[0]:give[1]], theirs, peer, tag)
        own_sq, their_sq = float(np.dot(mine, mine)), float(np.dot(theirs, theirs))
        # [a.b, |left|^2, |right|^2], partial over this slice; summed over the 2L ranks.
        terms = np.array([float(np.dot(mine, theirs)),
                          own_sq if is_left else their_sq,
                          their_sq if is_left else own_sq])
        dot, left_sq, right_sq = _group_sum(comm, terms, 2 * level, tag + 1)
        left_coeff, right_coeff = _coefficients(float(dot), float(left_sq), float(right_sq))
        own_coeff, their_coeff = (left_coeff, right_coeff) if is_left else (right_coeff, left_coeff)
        mine *= own_coeff
        mine += their_coeff * theirs
        given.append(give)
        lo, hi = keep
        level <<= 1

    # Allgather: hand the reduced slices back in reverse order, doubling each level.
    while given:
        level >>= 1
        give_lo, give_hi = given.pop()
        _sendrecv(comm, buf[lo:hi], buf[give_lo:give_hi], rank ^ level, tag)
        lo, hi = min(lo, give_lo), max(hi, give_hi)

    return buf.astype(array.dtype, copy=False)
