"""Tensors stored as the flat element ranges the ranks held, read back as any range (numpy only).

A rank saves each tensor it holds as one 1-D array: elements ``[start, stop)`` of
the tensor's row-major flattening (a ZeRO shard's piece, or an even slice of a
replicated tensor). The checkpoint's metadata lists each tensor's shape, dtype and
pieces; :class:`FlatReader` answers "elements ``[a, b)`` of tensor ``key``" from
the pieces that overlap them, so a checkpoint written on N ranks loads on any
number of ranks and any partition layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from ..core.errors import CheckpointError

__all__ = ["FlatPiece", "FlatTensor", "PieceWriter", "FlatReader", "even_range", "merge_tables", "storable"]


def even_range(numel: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s share ``[start, stop)`` of ``numel`` elements split over ``size`` ranks."""
    return rank * numel // size, (rank + 1) * numel // size


def storable(values: Any) -> np.ndarray:
    """``values`` as a numpy array ``np.savez`` stores without pickle (bfloat16 and other
    extension dtypes widened to float32)."""
    arr = np.asarray(values)
    if arr.dtype.kind not in "biuf":
        arr = arr.astype(np.float32)
    return arr


@dataclass(frozen=True)
class FlatPiece:
    """Elements ``[start, stop)`` of a tensor, stored 1-D as array ``array`` of rank ``rank``'s file."""

    rank: int
    array: str
    start: int
    stop: int


@dataclass(frozen=True)
class FlatTensor:
    """One stored tensor: its shape, its dtype when saved, and the pieces that hold it."""

    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[FlatPiece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype,
                "pieces": [[p.rank, p.array, p.start, p.stop] for p in self.pieces]}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "FlatTensor":
        try:
            return cls(tuple(int(d) for d in raw["shape"]), str(raw["dtype"]),
                       tuple(FlatPiece(int(r), str(a), int(s), int(e)) for r, a, s, e in raw["pieces"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed tensor entry {raw!r}: {exc}") from None


class PieceWriter:
    """What one rank writes: its arrays (for ``np.savez``) and the table of pieces they are."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.arrays: dict[str, np.ndarray] = {}
        self.table: dict[str, dict[str, Any]] = {}

    def add(self, key: str, shape: Sequence[int], dtype: str, start: int, values: Any) -> None:
        """Record ``values`` (1-D) as elements ``[start, start + len)`` of tensor ``key``.

        Every rank records every tensor's shape and dtype, even with no piece of it.
        """
        entry = self.table.setdefault(key, {"shape": [int(d) for d in shape], "dtype": str(dtype), "pieces": []})
        if entry["shape"] != [int(d) for d in shape]:
            raise CheckpointError(f"tensor {key!r} recorded with shapes {entry['shape']} and {list(shape)}")
        flat = storable(values).reshape(-1)
        if flat.size:
            name = f"a{len(self.arrays)}"
            self.arrays[name] = flat
            entry["pieces"].append([self.rank, name, int(start), int(start) + int(flat.size)])

    def declare(self, key: str, shape: Sequence[int], dtype: str) -> None:
        """Record tensor ``key`` with no piece held by this rank."""
        self.add(key, shape, dtype, 0, np.zeros(0, np.float32))


def merge_tables(tables: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, FlatTensor]:
    """Every rank's :attr:`PieceWriter.table` as one table; refuses gaps, overlaps and disagreements."""
    merged: dict[str, FlatTensor] = {}
    keys = sorted({k for t in tables for k in t})
    for key in keys:
        entries = [(r, t[key]) for r, t in enumerate(tables) if key in t]
        shape, dtype = tuple(entries[0][1]["shape"]), entries[0][1]["dtype"]
        for r, e in entries:
            if tuple(e["shape"]) != shape or e["dtype"] != dtype:
                raise CheckpointError(f"ranks disagree on tensor {key!r}: rank {entries[0][0]} has {shape} "
                                      f"{dtype}, rank {r} has {tuple(e['shape'])} {e['dtype']}")
        pieces = sorted((FlatPiece(*p) for _, e in entries for p in e["pieces"]), key=lambda p: p.start)
        at = 0
        for p in pieces:
            if p.start != at:
                what = "overlap" if p.start < at else "gap"
                raise CheckpointError(f"tensor {key!r}: the ranks' pieces leave a {what} at element "
                                      f"{min(at, p.start)} (rank {p.rank}'s piece starts at {p.start})")
            at = p.stop
        if at != math.prod(shape):
            raise CheckpointError(f"tensor {key!r}: the ranks' pieces cover {at} of its {math.prod(shape)} elements")
        merged[key] = FlatTensor(shape, dtype, tuple(pieces))
    return merged


class FlatReader:
    """Element ranges of a checkpoint's tensors, read from the pieces that hold them.

    ``open_rank(r)`` returns rank ``r``'s arrays (a lazily read ``np.load`` of its
    ``.npz`` is enough: only the arrays asked for are read); it is called once per rank.
    """

    def __init__(self, tensors: Mapping[str, FlatTensor], open_rank: Callable[[int], Mapping[str, np.ndarray]],
                 origin: str = "checkpoint") -> None:
        self.tensors = dict(tensors)
        self._open_rank = open_rank
        self._files: dict[int, Mapping[str, np.ndarray]] = {}
        self.origin = origin

    def has(self, key: str) -> bool:
        return key in self.tensors

    def tensor(self, key: str) -> FlatTensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError(f"{self.origin} has no tensor {key!r}") from None

    def _file(self, rank: int) -> Mapping[str, np.ndarray]:
        if rank not in self._files:
            self._files[rank] = self._open_rank(rank)
        return self._files[rank]

    def _slices(self, key: str, start: int, stop: int) -> list[np.ndarray]:
        """Views of the stored pieces that make up elements ``[start, stop)`` of ``key``, in order."""
        info = self.tensor(key)
        if not 0 <= start <= stop <= info.numel:
            raise CheckpointError(f"{self.origin}: range [{start}, {stop}) is outside tensor {key!r} "
                                  f"of {info.numel} elements")
        hits = [p for p in info.pieces if p.start < stop and p.stop > start]
        parts: list[np.ndarray] = []
        at = start
        for p in hits:
            try:
                stored = self._file(p.rank)[p.array]
            except KeyError:
                raise CheckpointError(f"{self.origin}: rank {p.rank}'s file lacks array {p.array!r} "
                                      f"of tensor {key!r}") from None
            if stored.shape != (p.stop - p.start,):
                raise CheckpointError(f"{self.origin}: array {p.array!r} of rank {p.rank} has shape "
                                      f"{stored.shape}, the table says ({p.stop - p.start},)")
            lo, hi = max(p.start, start), min(p.stop, stop)
            if lo != at:
                break
            parts.append(stored[lo - p.start:hi - p.start])
            at = hi
        if at != stop:
            raise CheckpointError(f"{self.origin}: tensor {key!r}: its pieces cover elements [{start}, {at}) "
                                  f"of the [{start}, {stop}) asked for (a damaged checkpoint)")
        return parts

    def read(self, key: str, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Elements ``[start, stop)`` of tensor ``key`` (1-D, in the stored dtype)."""
        parts = self._slices(key, start, self.tensor(key).numel if stop is None else stop)
        if not parts:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])

    def read_whole(self, key: str) -> np.ndarray:
        """Tensor ``key`` in its shape."""
        return self.read(key).reshape(self.tensor(key).shape)

    def read_into(self, out: np.ndarray, ranges: Iterable[tuple[str, int, int, int]]) -> np.ndarray:
        """Fill 1-D ``out``: for each ``(key, start, out_offset, length)`` copy elements
        ``[start, start + length)`` of ``key`` to ``out[out_offset:]``."""
        for key, start, offset, length in ranges:
            for part in self._slices(key, start, start + length):  # copied straight from the stored pieces
                out[offset:offset + part.size] = part
                offset += part.size
        return out

    def close(self) -> None:
        for f in self._files.values():
            close = getattr(f, "close", None)
            if close is not None:
                close()
        self._files.clear()
