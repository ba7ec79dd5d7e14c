"""Gradient buckets (tensor fusion) for data parallelism.

Parameters are grouped in reverse registration order — roughly the order in
which backward produces their gradients — into buckets of at most ``cap_bytes``,
so one collective moves many small gradients and the first bucket can be sent
while backward is still running. A parameter larger than the cap gets a bucket
of its own. The plan depends only on names, sizes and the cap, so every rank
computes the same one; :func:`plan_fingerprint` lets ranks verify that. A runtime
may re-plan with an explicit ``order`` (the order gradients actually became ready on
one rank, shared with the others), as torch DDP rebuilds its buckets after the first step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

from .errors import ConfigError

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "DEFAULT_SOLO_BYTES", "Bucket", "BucketPlan", "plan_buckets",
           "plan_fingerprint"]

#: 25 MiB, torch DDP's default ``bucket_cap_mb`` (Horovod's fusion threshold is 128 MiB).
DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024

#: Parameters this large get a bucket of their own: fusing them saves no per-call latency
#: worth the copy into a shared buffer, and alone their collective starts as soon as they are ready.
DEFAULT_SOLO_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    """Indices of the parameters fused into one collective, and where each sits in the flat buffer."""

    index: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return sum(self.numels)


@dataclass(frozen=True)
class BucketPlan:
    """All buckets, in the order their collectives are issued."""

    buckets: tuple[Bucket, ...]
    cap_bytes: int

    def bucket_of(self) -> dict[int, tuple[int, int]]:
        """Map parameter index -> (bucket index, position within the bucket)."""
        return {p: (b.index, i) for b in self.buckets for i, p in enumerate(b.params)}


def plan_buckets(numels: Sequence[int], dtypes: Sequence[str], itemsizes: Sequence[int],
                 cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, *, reverse: bool = True,
                 order: Optional[Sequence[int]] = None, solo_bytes: Optional[int] = None) -> BucketPlan:
    """Group parameters ``0..n-1`` into buckets of one dtype and at most ``cap_bytes`` each.

    ``numels``, ``dtypes`` and ``itemsizes`` describe the parameters in registration
    order; parameters are visited in reverse order when ``reverse`` is set, or in
    ``order`` (a permutation of ``0..n-1``, e.g. the order gradients became ready) when given.
    A parameter of at least ``solo_bytes`` bytes gets a bucket of its own, placed where it
    is visited, while the bucket of smaller ones being filled stays open.
    """
    if not len(numels) == len(dtypes) == len(itemsizes):
        raise ConfigError(f"numels ({len(numels)}), dtypes ({len(dtypes)}) and itemsizes "
                          f"({len(itemsizes)}) must have the same length")
    if cap_bytes <= 0:
        raise ConfigError(f"bucket cap must be a positive number of bytes, got {cap_bytes}")
    if solo_bytes is not None and solo_bytes <= 0:
        raise ConfigError(f"solo_bytes must be a positive number of bytes or None, got {solo_bytes}")
    if order is not None:
        order = [int(i) for i in order]
        if sorted(order) != list(range(len(numels))):
            raise ConfigError(f"bucket order must be a permutation of 0..{len(numels) - 1}, got {order[:8]}...")
    else:
        order = range(len(numels) - 1, -1, -1) if reverse else range(len(numels))
    buckets: list[Bucket] = []
    open_: dict[str, tuple[list[int], int]] = {}  # dtype -> (param indices, bytes)

    def close(dtype: str) -> None:
        members, _ = open_.pop(dtype)
        emit(members, dtype)

    def emit(members: list[int], dtype: str) -> None:
        offsets, numel_list, off = [], [], 0
        for p in members:
            offsets.append(off)
            numel_list.append(int(numels[p]))
            off += int(numels[p])
        buckets.append(Bucket(len(buckets), tuple(members), tuple(offsets), tuple(numel_list), dtype))

    for p in order:
        if numels[p] < 0:
            raise ConfigError(f"parameter {p} has negative size {numels[p]}")
        nbytes = int(numels[p]) * int(itemsizes[p])
        dtype = dtypes[p]
        if solo_bytes is not None and nbytes >= solo_bytes:
            emit([p], dtype)
            continue
        if dtype in open_ and open_[dtype][1] + nbytes > cap_bytes:
            close(dtype)
        members, used = open_.get(dtype, ([], 0))
        members.append(p)
        open_[dtype] = (members, used + nbytes)
    for dtype in list(open_):
        close(dtype)
    return BucketPlan(tuple(buckets), int(cap_bytes))


def plan_fingerprint(names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> str:
    """A short hash of the parameter list; ranks compare it to catch models that differ."""
    h = hashlib.sha256()
    for name, shape, dtype in zip(names, shapes, dtypes):
        h.update(f"{name}:{tuple(int(d) for d in shape)}:{dtype};".encode())
    return h.hexdigest()[:16]
