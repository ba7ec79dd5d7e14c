"""What a rank says about the collective it is entering, and how disagreements read.

A :class:`CallDesc` is encoded as a fixed-size int64 vector (hashes of the name,
dtype and shape) so that ranks can compare calls with one tiny allgather; the
readable form travels only after a disagreement was seen.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["CallDesc", "VECTOR_LEN", "UNIFORM", "describe_tensor", "describe_mismatch", "first_divergence"]

#: Marks a descriptor vector (and its layout version).
MAGIC = 0x5357_4331
#: Length of an encoded descriptor: magic, seq, kind, name, op, dtype, shape, root, extra, digest.
VECTOR_LEN = 10
#: Collectives whose first dimension may differ per rank (only trailing dims must match).
ROW_FLEXIBLE = frozenset({"allgather", "alltoall"})
#: ``extra`` of an allgather called with ``uniform=True``: its whole shape must match.
UNIFORM = "uniform shapes"
KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall", "barrier",
         "allgather_object", "broadcast_object", "split", "free")


def _crc(value: Any) -> int:
    return 0 if value is None else zlib.crc32(repr(value).encode())


def describe_tensor(tensor: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of a numpy array, torch tensor or TF tensor, without importing them."""
    dtype = getattr(tensor, "dtype", None)
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):
        name = str(dtype) if dtype is not None else type(tensor).__name__
    name = name.removeprefix("torch.")
    shape = getattr(tensor, "shape", None)
    shape = tuple(int(d) for d in (np.shape(tensor) if shape is None else shape))
    return name, shape


@dataclass(frozen=True)
class CallDesc:
    """One rank's account of one collective call."""

    seq: int
    kind: str
    name: Optional[str] = None
    op: Optional[str] = None
    dtype: Optional[str] = None
    shape: Optional[tuple[int, ...]] = None
    root: Optional[int] = None
    extra: Optional[str] = None

    def matched_shape(self) -> Optional[tuple[int, ...]]:
        """The part of the shape every rank must agree on."""
        if self.shape is not None and self.kind in ROW_FLEXIBLE and self.extra != UNIFORM:
            return self.shape[1:]
        return self.shape

    def key(self) -> tuple:
        """Everything that must be equal on every rank."""
        return (self.seq, self.kind, self.name, self.op, self.dtype, self.matched_shape(),
                self.root, self.extra)

    def encode(self, digest: int = 0) -> np.ndarray:
        """The fixed-size int64 vector exchanged between ranks."""
        return np.array([MAGIC, self.seq, KINDS.index(self.kind), _crc(self.name), _crc(self.op),
                         _crc(self.dtype), _crc(self.matched_shape()), -1 if self.root is None else self.root,
                         _crc(self.extra), digest], dtype=np.int64)

    def label(self) -> str:
        """``allreduce #12 'grad_bucket_3'``."""
        return f"{self.kind} #{self.seq}" + (f" {self.name!r}" if self.name is not None else "")

    def tensor_text(self) -> str:
        return f"{self.shape} {self.dtype}" if self.shape is not None else "no tensor"


def chain_digest(digest: int, desc: CallDesc) -> int:
    """Fold ``desc`` into a running digest of unchecked calls."""
    return zlib.crc32(repr(desc.key()).encode(), digest)


def _who(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} have"


def _who_called(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def describe_mismatch(descs: Sequence[CallDesc]) -> str:
    """One message naming which ranks differ from which, and in what.

    ``descs[r]`` is rank ``r``'s call. The largest group of agreeing ranks (on a tie,
    the one with the lowest rank) is the reference and is listed last.
    """
    groups: dict[tuple, list[int]] = {}
    for rank, d in enumerate(descs):
        groups.setdefault(d.key(), []).append(rank)
    ref_ranks = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
    ordered = sorted((rs for rs in groups.values() if rs is not ref_ranks), key=lambda rs: (len(rs), rs[0]))
    ordered.append(ref_ranks)
    ref = descs[ref_ranks[0]]

    def differs(field: str) -> bool:
        return len({getattr(d, field) if field != "matched_shape" else d.matched_shape() for d in descs}) > 1

    firsts = [descs[rs[0]] for rs in ordered]
    if differs("seq"):
        parts = [f"{_who_called(rs)} at {d.label()}" for rs, d in zip(ordered, firsts)]
        return (f"collective sequence out of step: {', '.join(parts)} (a rank kept going after a "
                "failed collective, or an earlier timeout was caught and ignored)")
    if differs("kind") or differs("name"):
        parts = [f"{_who_called(rs)} called {d.kind}" + (f" {d.name!r}" if d.name is not None else "")
                 + (f" ({d.tensor_text()})" if d.shape is not None else "") for rs, d in zip(ordered, firsts)]
        return (f"collective #{ref.seq}: {', '.join(parts)}; every rank must make the same collectives "
                "in the same order (a rank skipped one or called an extra one)")
    if differs("op"):
        parts = [f"{_who(rs)} reduce op {d.op}" for rs, d in zip(ordered, firsts)]
        return f"{ref.label()}: {', '.join(parts)}"
    if differs("root"):
        parts = [f"{_who(rs)} root {d.root}" for rs, d in zip(ordered, firsts)]
        return f"{ref.label()}: {', '.join(parts)}"
    if differs("extra"):
        parts = [f"{_who(rs)} {d.extra}" for rs, d in zip(ordered, firsts)]
        return f"{ref.label()}: {', '.join(parts)}"
    parts = [f"{_who(rs)} {'shape ' if i == 0 else ''}{d.tensor_text()}"
             for i, (rs, d) in enumerate(zip(ordered, firsts))]
    flexible = ref.kind in ROW_FLEXIBLE and ref.extra != UNIFORM
    note = f" ({ref.kind}: only the first dimension may differ)" if flexible else ""
    return f"{ref.label()}: {', '.join(parts)}{note}"


def first_divergence(histories: Sequence[Sequence[CallDesc]]) -> int:
    """Index of the first call on which the ranks' histories disagree (-1 if none)."""
    for i, calls in enumerate(zip(*histories)):
        if len({c.key() for c in calls}) > 1:
            return i
    return -1
