"""Variable-length ids per sample and feature: the ``KeyedJaggedTensor`` convention of TorchRec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ....core.errors import ShapeMismatchError

__all__ = ["KeyedJaggedTensor"]


@dataclass(frozen=True)
class KeyedJaggedTensor:
    """Ids of several sparse features for a batch: ``values`` of every (feature, sample) bag, feature-major.

    ``lengths[k * batch + i]`` is the number of ids of feature ``keys[k]`` in sample ``i``;
    ``weights`` (optional) gives one weight per id, for weighted pooling.
    """

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        if not self.keys or len(set(self.keys)) != len(self.keys):
            raise ShapeMismatchError(f"keys must be distinct and non-empty, got {self.keys!r}")
        if self.values.dim() != 1 or self.lengths.dim() != 1:
            raise ShapeMismatchError(f"values and lengths must be 1-D, got {tuple(self.values.shape)} and "
                                     f"{tuple(self.lengths.shape)}")
        if self.lengths.numel() % len(self.keys):
            raise ShapeMismatchError(f"{self.lengths.numel()} lengths do not split into {len(self.keys)} keys")
        if bool((self.lengths < 0).any()) or int(self.lengths.sum()) != self.values.numel():
            raise ShapeMismatchError(f"lengths (sum {int(self.lengths.sum())}) must be >= 0 and add up to the "
                                     f"{self.values.numel()} values")
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise ShapeMismatchError(f"weights {tuple(self.weights.shape)} must match values "
                                     f"{tuple(self.values.shape)}")

    @classmethod
    def from_lengths(cls, keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor,
                     weights: Optional[torch.Tensor] = None) -> "KeyedJaggedTensor":
        """From per-(feature, sample) lengths."""
        return cls(tuple(keys), values.long(), lengths.long(), weights)

    @classmethod
    def from_offsets(cls, keys: Sequence[str], values: torch.Tensor, offsets: torch.Tensor,
                     weights: Optional[torch.Tensor] = None) -> "KeyedJaggedTensor":
        """From offsets (``len(keys) * batch + 1`` of them, starting at 0)."""
        offsets = offsets.long()
        if offsets.dim() != 1 or offsets.numel() < 1 or int(offsets[0]) != 0:
            raise ShapeMismatchError("offsets must be 1-D and start at 0")
        return cls(tuple(keys), values.long(), offsets[1:] - offsets[:-1], weights)

    @property
    def batch_size(self) -> int:
        """Samples in the batch."""
        return self.lengths.numel() // len(self.keys)

    def feature(self, key: str) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``(values, lengths, weights)`` of one feature."""
        if key not in self.keys:
            raise ShapeMismatchError(f"feature {key!r} is not in this batch; features: {list(self.keys)}")
        k, b = self.keys.index(key), self.batch_size
        per_key = self.lengths.view(len(self.keys), b).sum(dim=1).tolist()
        start = sum(per_key[:k])
        stop = start + per_key[k]
        weights = None if self.weights is None else self.weights[start:stop]
        return self.values[start:stop], self.lengths[k * b:(k + 1) * b], weights
