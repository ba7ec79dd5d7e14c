"""Data sharding and learning-rate scaling for data parallelism.

:func:`shard_indices` gives each rank its share of a dataset, exactly as
``torch.utils.data.DistributedSampler`` does (same shuffle, same padding), and
:class:`DistributedSampler` wraps it as a sampler. :func:`scale_lr` applies the
usual learning-rate scaling rule for a global batch ``size`` times larger.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Sized

import torch
from torch.utils.data import Sampler

from shardwise.context import current
from shardwise.core.errors import ConfigError

__all__ = ["shard_indices", "DistributedSampler", "scale_lr"]


def shard_indices(n: int, rank: int, size: int, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                  drop_last: bool = False) -> list[int]:
    """This rank's indices into a dataset of ``n`` items; every rank gets the same number.

    With ``shuffle`` the order is a permutation seeded by ``seed + epoch`` (the same
    on every rank). Without ``drop_last`` the list is padded by repeating indices
    from the start; with it the tail that does not divide evenly is dropped.
    Rank ``r`` takes positions ``r, r + size, r + 2*size, ...``.
    """
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is not in a group of size {size}")
    if n < 0:
        raise ConfigError(f"dataset size must be non-negative, got {n}")
    if drop_last and n % size:
        per_rank = math.ceil((n - size) / size)
    else:
        per_rank = math.ceil(n / size)
    total = per_rank * size
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        indices = torch.randperm(n, generator=g).tolist()
    else:
        indices = list(range(n))
    if not drop_last:
        pad = total - len(indices)
        if pad > 0 and indices:
            indices += (indices * math.ceil(pad / len(indices)))[:pad]
    else:
        indices = indices[:total]
    return indices[rank:total:size]


class DistributedSampler(Sampler[int]):
    """A sampler yielding :func:`shard_indices` of ``dataset``; call :meth:`set_epoch` each epoch.

    ``num_replicas`` and ``rank`` default to the current shardwise world.
    """

    def __init__(self, dataset: Sized, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            world = current().world
            num_replicas = world.size if num_replicas is None else num_replicas
            rank = world.rank if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"rank {rank} is not in [0, {num_replicas})")
        self.dataset, self.num_replicas, self.rank = dataset, int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, int(seed), drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        """Use a different shuffle for ``epoch`` (same on every rank)."""
        self.epoch = int(epoch)

    def _indices(self) -> list[int]:
        return shard_indices(len(self.dataset), self.rank, self.num_replicas, self.shuffle, self.seed,
                             self.epoch, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        n = len(self.dataset)
        if self.drop_last and n % self.num_replicas:
            return math.ceil((n - self.num_replicas) / self.num_replicas)
        return math.ceil(n / self.num_replicas)


def scale_lr(base_lr: float, size: int, rule: str = "linear") -> float:
    """The learning rate for ``size`` ranks, given one tuned for a single rank's batch.

    ``"linear"`` (Goyal et al., 2017; Horovod's advice): ``base_lr * size``, best
    combined with a few epochs of warm-up from ``base_lr``. ``"sqrt"``:
    ``base_lr * sqrt(size)``, often better for adaptive optimizers (Adam) and
    very large batches. ``"none"``: ``base_lr`` (when the per-rank batch is
    divided by ``size`` so that the global batch is unchanged).
    """
    if size < 1:
        raise ConfigError(f"size must be >= 1, got {size}")
    rules = {"linear": float(size), "sqrt": math.sqrt(size), "none": 1.0}
    if rule not in rules:
        raise ConfigError(f"unknown lr scaling rule {rule!r}; expected one of {', '.join(rules)}")
    return float(base_lr) * rules[rule]
