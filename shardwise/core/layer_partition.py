"""Split a stack of layers into contiguous pipeline stages of balanced cost.

:func:`partition_layers` is exact: it minimises the cost of the most expensive
stage (the pipeline's bottleneck). Among the partitions that reach that minimum
it picks, deterministically, the most balanced one (smallest sum of squared
stage costs) and, among those, the one with the earliest boundaries
(lexicographically smallest tuple of stage starts).

Stage costs are compared as differences of one prefix-sum array, so equal
splits compare equal; :func:`stage_costs` sums each range with ``math.fsum``.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .errors import ConfigError

__all__ = ["PartitionError", "partition_layers", "stage_costs"]


class PartitionError(ConfigError):
    """Layer costs or a stage count that cannot be partitioned."""


def _validated(costs: Sequence[float]) -> np.ndarray:
    try:
        arr = np.asarray(list(costs), dtype=np.float64)
    except (TypeError, ValueError):
        raise PartitionError("layer costs must be a sequence of numbers") from None
    if arr.ndim != 1:
        raise PartitionError(f"layer costs must be one-dimensional, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise PartitionError("layer costs must be finite")
    if np.any(arr < 0):
        bad = int(np.flatnonzero(arr < 0)[0])
        raise PartitionError(f"layer costs must be >= 0; layer {bad} costs {arr[bad]}")
    return arr


def _min_bottleneck(prefix: np.ndarray, num_stages: int) -> float:
    """Smallest achievable maximum stage cost: binary search over all range sums."""
    n = len(prefix) - 1
    diffs = prefix[None, :] - prefix[:, None]
    candidates = np.unique(diffs[np.triu_indices(n + 1, k=1)])

    def stages_needed(limit: float) -> int:
        # greedy: extend each stage while it fits under ``limit``
        count, start = 1, 0
        for i in range(1, n + 1):
            if prefix[i] - prefix[start] > limit:
                count, start = count + 1, i - 1
        return count

    lo, hi = 0, len(candidates) - 1  # candidates[hi] (whole stack) always fits in 1 stage
    while lo < hi:
        mid = (lo + hi) // 2
        # a limit below a single layer's cost can never fit; the greedy above then
        # just counts layers, so also require every layer to fit
        if candidates[mid] >= np.max(np.diff(prefix)) and stages_needed(candidates[mid]) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    return float(candidates[lo])


def partition_layers(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous, non-empty split of ``costs`` into ``num_stages`` ranges minimising the max cost.

    Time ``O(num_stages * n**2)`` vectorised with numpy, memory ``O(n**2)``.
    """
    arr = _validated(costs)
    n = len(arr)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if num_stages > n:
        raise PartitionError(f"cannot split {n} layers into {num_stages} non-empty stages")
    prefix = np.concatenate(([0.0], np.cumsum(arr)))
    limit = _min_bottleneck(prefix, num_stages)

    # seg[i, t]: cost of layers i..t-1, allowed only for t > i and cost <= limit
    seg = prefix[None, :] - prefix[:, None]
    square = np.where((np.arange(n + 1)[None, :] > np.arange(n + 1)[:, None]) & (seg <= limit),
                      seg * seg, np.inf)
    # best[j][i]: least sum of squares splitting layers i..n-1 into j stages
    best = [np.full(n + 1, np.inf)]
    best[0][n] = 0.0
    for _ in range(num_stages):
        best.append(np.min(square + best[-1][None, :], axis=1))
    if not np.isfinite(best[num_stages][0]):  # pragma: no cover - limit is feasible by construction
        raise PartitionError("internal error: no partition under the optimal bottleneck")

    ranges, start = [], 0
    for j in range(num_stages, 0, -1):
        totals = square[start] + best[j - 1]
        target = best[j][start]
        tol = 1e-12 * max(1.0, abs(target))
        end = int(np.flatnonzero(totals <= target + tol)[0])  # earliest boundary among ties
        ranges.append(range(start, end))
        start = end
    return ranges


def stage_costs(costs: Sequence[float], ranges: Sequence[range]) -> list[float]:
    """Total cost of each stage's range of layers."""
    arr = _validated(costs)
    out = []
    for rng in ranges:
        if not isinstance(rng, range) or rng.step != 1:
            raise PartitionError(f"stages must be ranges with step 1, got {rng!r}")
        if rng.start < 0 or rng.stop > len(arr) or rng.start > rng.stop:
            raise PartitionError(f"stage {rng!r} is outside the {len(arr)} layers")
        out.append(math.fsum(arr[rng.start:rng.stop].tolist()))
    return out
