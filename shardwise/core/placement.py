"""Where a rank's piece of a model tensor sits in the whole tensor, independent of any framework.

A tensor of a model is known by its *canonical* name and shape: those of the model
built in one process (for a Hugging Face model, the names and shapes of its
``state_dict`` and of its ``save_pretrained`` files). A tensor-parallel rank keeps
some index ranges of it along one dimension, concatenated in order (a fused QKV
projection: one range per part), possibly transposed (Hugging Face's ``Conv1D`` stores
``[in, out]``, the sharded linear keeps ``[out, in]``). A :class:`Placement` says
which; loading, initialising, gathering and saving all read it instead of
re-deriving the split rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .errors import ConfigError

__all__ = ["Placement", "split_ranges", "uneven_range"]


def split_ranges(length: int, parts: int, size: int, rank: int) -> tuple[tuple[int, int], ...]:
    """Rank ``rank`` of ``size``'s ranges of ``length`` items made of ``parts`` equal blocks.

    Each block is split into ``size`` equal slices and the rank keeps its slice of
    every block, in block order (one range when ``parts`` is 1).
    """
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is not in a group of {size}")
    if parts < 1 or length % parts or (length // parts) % size:
        raise ConfigError(f"{length} items in {parts} equal part(s) do not split over {size} ranks")
    width = length // parts
    step = width // size
    return tuple((p * width + rank * step, p * width + (rank + 1) * step) for p in range(parts))


def uneven_range(length: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows of ``length`` split in blocks of ``ceil(length / size)``, the last one short
    (a vocabulary that the tensor-parallel degree does not divide)."""
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is not in a group of {size}")
    block = -(-length // size)
    if block * (size - 1) >= length:
        raise ConfigError(f"{length} rows leave a rank of {size} without any")
    return min(rank * block, length), min((rank + 1) * block, length)


@dataclass(frozen=True)
class Placement:
    """This rank's piece of canonical tensor ``name`` (``full_shape``), split over a group of ``size``."""

    name: str
    full_shape: tuple[int, ...]
    dim: Optional[int] = None
    """The split dimension in the canonical layout; None for a tensor every rank holds whole."""
    parts: int = 1
    size: int = 1
    rank: int = 0
    transpose: bool = False
    """The local tensor is the transpose of the kept (2-D) piece."""
    bounds: Optional[tuple[tuple[int, int], ...]] = None
    """Explicit ranges along :attr:`dim` held by one local tensor that is only part of what this
    rank holds of the tensor (a vocabulary chunk); no group split (``size`` 1)."""
    uneven: bool = False
    """The split gives each rank ``ceil(n / size)`` items along :attr:`dim`, the last rank fewer
    (:func:`uneven_range`; one part only)."""
    replicas: int = 1
    """Consecutive ranks of the group holding the same piece: the tensor is split ``size // replicas``
    ways and rank ``r`` holds piece ``r // replicas`` (key/value heads fewer than the tensor-parallel
    degree, each kept by ``tp / kv_heads`` ranks, as vLLM's ``num_kv_head_replicas``)."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.size % self.replicas:
            raise ConfigError(f"{self.name}: {self.replicas} replicas do not divide a group of {self.size}")
        if self.replicas > 1 and (self.dim is None or self.uneven or self.bounds is not None):
            raise ConfigError(f"{self.name}: only an even split over a group can be replicated")
        if self.dim is not None:
            if not 0 <= self.dim < len(self.full_shape):
                raise ConfigError(f"{self.name}: split dim {self.dim} of a {len(self.full_shape)}-D tensor")
            if self.uneven:
                if self.parts != 1 or self.bounds is not None:
                    raise ConfigError(f"{self.name}: an uneven split has one part and no bounds")
                uneven_range(self.full_shape[self.dim], self.size, self.rank)
            elif self.bounds is None:
                split_ranges(self.full_shape[self.dim], self.parts, self.size // self.replicas,
                             self.rank // self.replicas)
            elif self.size != 1 or not all(0 <= a < b <= self.full_shape[self.dim] for a, b in self.bounds):
                raise ConfigError(f"{self.name}: bounds {self.bounds} outside dim {self.dim} of {self.full_shape} "
                                  f"or with a group of {self.size}")
        if self.transpose and len(self.full_shape) != 2:
            raise ConfigError(f"{self.name}: only a 2-D tensor can be kept transposed")

    @property
    def sharded(self) -> bool:
        """Split over a group (tensor parallelism): the whole tensor needs every rank's piece."""
        return self.dim is not None and self.size > 1

    def canonical(self) -> "Placement":
        """The same piece without replicas: split ``size // replicas`` ways, held by piece index
        ``rank // replicas`` (equal on every rank that holds the same values)."""
        if self.replicas == 1:
            return self
        return replace(self, size=self.size // self.replicas, rank=self.rank // self.replicas, replicas=1)

    @property
    def partial(self) -> bool:
        """A chunk of what this rank holds (:attr:`bounds`): the whole tensor needs its other chunks."""
        return self.bounds is not None

    def ranges(self, rank: Optional[int] = None) -> tuple[tuple[int, int], ...]:
        """The ranges along :attr:`dim` that ``rank`` (default: this rank) keeps."""
        if self.dim is None:
            return ()
        if self.bounds is not None:
            return self.bounds
        if self.uneven:
            return (uneven_range(self.full_shape[self.dim], self.size, self.rank if rank is None else rank),)
        return split_ranges(self.full_shape[self.dim], self.parts, self.size // self.replicas,
                            (self.rank if rank is None else rank) // self.replicas)

    @property
    def kept_shape(self) -> tuple[int, ...]:
        """Shape of the piece in the canonical layout (before any transpose)."""
        shape = list(self.full_shape)
        if self.dim is not None:
            shape[self.dim] = sum(b - a for a, b in self.ranges())
        return tuple(shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the tensor this rank holds."""
        shape = self.kept_shape
        return shape[::-1] if self.transpose else shape

    def boxes(self) -> list[tuple[slice, ...]]:
        """Index boxes of the full tensor whose concatenation along :attr:`dim` is the kept piece."""
        whole = [slice(0, n) for n in self.full_shape]
        if self.dim is None:
            return [tuple(whole)]
        out = []
        for a, b in self.ranges():
            box = list(whole)
            box[self.dim] = slice(a, b)
            out.append(tuple(box))
        return out

    def take(self, full: np.ndarray) -> np.ndarray:
        """This rank's piece of ``full`` (numpy reference of the adapters' slicing)."""
        if tuple(full.shape) != self.full_shape:
            raise ConfigError(f"{self.name}: shape {tuple(full.shape)}, expected {self.full_shape}")
        piece = np.concatenate([full[b] for b in self.boxes()], axis=self.dim or 0)
        return piece.T if self.transpose else piece

    def merge(self, pieces: list[np.ndarray]) -> np.ndarray:
        """The full tensor from every rank's piece, in rank order (numpy reference)."""
        if len(pieces) != self.size:
            raise ConfigError(f"{self.name}: {len(pieces)} pieces for a group of {self.size}")
        full = np.empty(self.full_shape, dtype=pieces[0].dtype)
        for r, piece in enumerate(pieces):
            piece = piece.T if self.transpose else piece
            at = 0
            for a, b in self.ranges(r):
                index = [slice(None)] * len(self.full_shape)
                index[self.dim] = slice(a, b)
                src = [slice(None)] * len(self.full_shape)
                src[self.dim] = slice(at, at + b - a)
                full[tuple(index)] = piece[tuple(src)]
                at += b - a
        return full
