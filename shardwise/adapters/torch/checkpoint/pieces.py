"""Tensors of a parallel-model checkpoint stored as the pieces the ranks held, read back as any box.

A rank saves what it holds as it holds it: its tensor-parallel slice of a tensor
(described by a :class:`~shardwise.core.placement.Placement`), or a contiguous range
of that slice's row-major elements (a ZeRO shard), stored 1-D. The checkpoint's
metadata lists every tensor's pieces: file, name in the file, placement and element
range. :class:`PiecesSource` answers "this box of canonical tensor ``name``" by
reading from each overlapping piece only the elements of the rows the box covers,
so a layout of any shape and world size loads what it keeps without reading whole
tensors. A checkpoint of format version 1 (whole tensors, one per name) reads
through the same class: each tensor is then one piece that covers it. Every file is
opened with its block checksums from the checkpoint's manifest, so each read checks
the blocks it touches (:mod:`.blocks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from ....core.errors import CheckpointError
from ....core.placement import Placement
from ....checkpoint.blocks import BlockChecksums
from ....checkpoint.manifest import read_manifest
from ....checkpoint.safetensors_read import open_checked
from .safetensors_torch import TorchSafetensorsFile

__all__ = ["StoredPiece", "PiecesSource", "WholeTensorsSource", "entry_source", "encode_placement", "decode_placement",
           "scatter_segment"]

Box = tuple[tuple[int, int], ...]


def encode_placement(p: Placement) -> list:
    """JSON form of a placement's split (its name and shape are the tensor's); a replicated piece is
    stored as the piece it is (:meth:`~shardwise.core.placement.Placement.canonical`)."""
    p = p.canonical()
    return [p.dim, p.parts, p.size, p.rank, p.transpose, [list(b) for b in p.bounds] if p.bounds else None,
            p.uneven]


def decode_placement(key: str, shape: Sequence[int], raw: Sequence[Any]) -> Placement:
    dim, parts, size, rank, transpose, bounds = raw[:6]
    return Placement(key, tuple(int(s) for s in shape), dim, int(parts), int(size), int(rank), bool(transpose),
                     tuple((int(a), int(b)) for a, b in bounds) if bounds else None, bool(raw[6:] and raw[6]))


@dataclass(frozen=True)
class StoredPiece:
    """Elements ``[start, stop)`` of the local tensor ``placement`` describes, stored 1-D as
    tensor ``name`` of ``file`` (format 1: the whole tensor, stored as itself)."""

    file: Path
    name: str
    placement: Placement
    start: int
    stop: int


def scatter_segment(values: torch.Tensor, start: int, shape: Sequence[int], box: Box, dst: torch.Tensor) -> int:
    """Copy into ``dst`` the elements of ``values`` that lie in ``box``; returns how many.

    ``values`` are the row-major elements ``[start, start + len)`` of a tensor of
    ``shape``; ``dst`` is a view of ``box``'s shape (``box``: ``(lo, hi)`` per dim).
    """
    n = values.numel()
    end = start + n
    if not shape:
        if n:
            dst.copy_(values.reshape(()))
        return n
    lo, hi = box[0]
    if len(shape) == 1:
        a, b = max(lo, start), min(hi, end)
        if a >= b:
            return 0
        dst[a - lo: b - lo].copy_(values[a - start: b - start])
        return b - a
    row = math.prod(shape[1:])
    inner = box[1:]
    first_full, last_full = -(-start // row), end // row  # rows [first_full, last_full) are whole
    if first_full > last_full:  # the segment lies inside one row
        r = start // row
        return scatter_segment(values, start - r * row, shape[1:], inner, dst[r - lo]) if lo <= r < hi else 0
    count = 0
    if start % row and lo <= first_full - 1 < hi:
        r = first_full - 1
        count += scatter_segment(values[: first_full * row - start], start - r * row, shape[1:], inner, dst[r - lo])
    a, b = max(first_full, lo), min(last_full, hi)
    if a < b:
        block = values[a * row - start: b * row - start].view((b - a,) + tuple(shape[1:]))
        dst[a - lo: b - lo].copy_(block[(slice(None),) + tuple(slice(x, y) for x, y in inner)])
        count += (b - a) * math.prod(y - x for x, y in inner)
    if end % row and lo <= last_full < hi:
        count += scatter_segment(values[last_full * row - start:], 0, shape[1:], inner, dst[last_full - lo])
    return count


def _local_boxes(p: Placement) -> list[tuple[Box, int]]:
    """The canonical boxes of ``p``'s kept piece with each one's offset along ``p.dim`` in the piece."""
    whole = tuple((0, n) for n in p.full_shape)
    if p.dim is None:
        return [(whole, 0)]
    out, at = [], 0
    for a, b in p.ranges():
        out.append((whole[: p.dim] + ((a, b),) + whole[p.dim + 1:], at))
        at += b - a
    return out


class PiecesSource:
    """Reads boxes of a checkpoint's tensors from the pieces that hold them.

    Answers the same calls as :class:`~shardwise.adapters.torch.parallel.weights.SafetensorsSource`
    (``files``, ``shape``, ``read``, ``read_rows``, ``close``), so loading code is the same
    for whole-tensor and pieced checkpoints. ``checksums`` maps a file to its block checksums; every
    read from such a file checks the blocks it touches.
    """

    def __init__(self, tensors: Mapping[str, tuple[tuple[int, ...], list[StoredPiece]]], origin: str,
                 checksums: Optional[Mapping[Path, BlockChecksums]] = None) -> None:
        self.files = {k: pieces for k, (_, pieces) in tensors.items()}
        self._shapes = {k: tuple(shape) for k, (shape, _) in tensors.items()}
        self.origin = origin
        self._checksums = dict(checksums or {})
        self._handles: dict[Path, TorchSafetensorsFile] = {}

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], where: Path) -> "PiecesSource":
        """The tensors of the checkpoint in ``where`` from its manifest metadata (format 1 or 2); reads
        are checked against the block checksums its manifest records (a manifest of SHA-256s only, from
        before block checksums, leaves them unchecked)."""
        tensors: dict[str, tuple[tuple[int, ...], list[StoredPiece]]] = {}
        checksums = {where / name: blocks for name, entry in read_manifest(where).files.items()
                     if (blocks := entry.blocks) is not None}
        if "tensors" not in meta:  # format 1: whole tensors, found by name
            return WholeTensorsSource({k: where / f for k, f in meta.get("weight_map", {}).items()}, str(where),
                                      checksums)
        files = [where / f for f in meta["files"]]
        try:
            for key, info in meta["tensors"].items():
                shape = tuple(int(s) for s in info["shape"])
                tensors[key] = (shape, [StoredPiece(files[f], name, decode_placement(key, shape, pl), int(a), int(b))
                                        for f, name, pl, a, b in info["pieces"]])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{where}: the manifest's tensor table is malformed ({exc!r})") from None
        return cls(tensors, str(where), checksums)

    def _file(self, path: Path) -> TorchSafetensorsFile:
        return open_checked(self._handles, path, self._checksums.get(path), self.origin, TorchSafetensorsFile)

    def _pieces(self, name: str) -> list[StoredPiece]:
        try:
            return self.files[name]
        except KeyError:
            raise CheckpointError(f"{self.origin} has no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        self._pieces(name)
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of tensor ``name``."""
        piece = self._pieces(name)[0]
        return self._file(piece.file).dtype(piece.name)

    def read_box(self, name: str, box: Iterable[slice]) -> torch.Tensor:
        """Box ``box`` (one slice per dim, steps of 1) of canonical tensor ``name``, in its stored dtype."""
        full = self.shape(name)
        want: Box = tuple(s.indices(n)[:2] for s, n in zip(tuple(box) + (slice(None),) * len(full), full))
        out: Optional[torch.Tensor] = None
        filled = 0
        for piece in self._pieces(name):
            f = self._file(piece.file)
            local = piece.placement.local_shape
            for canon, at in _local_boxes(piece.placement):
                hit = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, canon))
                if any(a >= b for a, b in hit):
                    continue
                dst_index = tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(hit, want))
                kept = list(hit)
                if piece.placement.dim is not None:
                    d = piece.placement.dim
                    shift = at - canon[d][0]
                    kept[d] = (hit[d][0] + shift, hit[d][1] + shift)
                if piece.placement.transpose:
                    kept.reverse()
                row = math.prod(local[1:]) if local else 1
                lo = max(piece.start, kept[0][0] * row) if local else piece.start
                hi = min(piece.stop, kept[0][1] * row) if local else piece.stop
                if lo >= hi:
                    continue
                values = f.read(piece.name, (slice(lo - piece.start, hi - piece.start),))
                if out is None:
                    out = torch.empty(tuple(b - a for a, b in want), dtype=values.dtype)
                dst = out[dst_index]
                filled += scatter_segment(values, lo, local, tuple(kept), dst.t() if piece.placement.transpose
                                          else dst)
        numel = math.prod(b - a for a, b in want)
        if filled != numel or out is None:
            raise CheckpointError(f"{self.origin}: tensor {name!r}: its stored pieces cover {filled} of the {numel} "
                                  f"values of box {list(want)} (a damaged checkpoint)")
        return out

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> bool:
        """Fill ``out`` (1-D) with elements ``[start, start + len)`` of the whole row-major tensor ``name``,
        reading straight into it; False (nothing read) when a piece holding them is a tensor-parallel slice
        or ``out`` is not a contiguous CPU tensor of the stored dtype."""
        stop = start + out.numel()
        pieces = self._pieces(name)
        # A tensor-parallel piece's element range counts in its slice, not in the whole tensor, so
        # whole-tensor ranges are comparable only when no piece of the tensor is a slice.
        if out.device.type != "cpu" or not out.is_contiguous() or any(
                p.placement.dim is not None or p.placement.transpose for p in pieces):
            return False
        hits = [p for p in pieces if p.start < stop and p.stop > start]
        filled = 0
        for p in hits:
            lo, hi = max(p.start, start), min(p.stop, stop)
            f = self._file(p.file)
            if f.dtype(p.name) != out.dtype:
                return False
            f.read_into(p.name, lo - p.start, out[lo - start: hi - start])
            filled += hi - lo
        if filled != stop - start:
            raise CheckpointError(f"{self.origin}: tensor {name!r}: its stored pieces cover {filled} of its "
                                  f"elements [{start}, {stop}) (a damaged checkpoint)")
        return True

    def read(self, name: str, placement: Placement) -> torch.Tensor:
        """This rank's piece of tensor ``name`` laid out as ``placement`` says (stored dtype)."""
        shape = self.shape(name)
        if shape != placement.full_shape:
            raise CheckpointError(f"{self.origin}: tensor {name!r} has shape {shape}, the model has "
                                  f"{placement.full_shape}")
        if not shape:
            return self.read_box(name, ())
        piece = torch.cat([self.read_box(name, box) for box in placement.boxes()], dim=placement.dim or 0)
        return (piece.t() if placement.transpose else piece).contiguous()

    def read_rows(self, name: str, full_shape: tuple[int, ...], first: int, last: int) -> torch.Tensor:
        """Rows ``[first, last)`` (along dim 0) of tensor ``name``, whose shape must be ``full_shape``."""
        if self.shape(name) != tuple(full_shape):
            raise CheckpointError(f"{self.origin}: tensor {name!r} has shape {self.shape(name)}, the model "
                                  f"has {tuple(full_shape)}")
        return self.read_box(name, (slice(first, last),))

    def read_whole(self, name: str) -> torch.Tensor:
        return self.read_box(name, ())

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


class WholeTensorsSource(PiecesSource):
    """Safetensors files that store every tensor whole under its own name (a ``save_pretrained``
    directory, a format 1 checkpoint)."""

    def __init__(self, files: Mapping[str, Path], origin: str,
                 checksums: Optional[Mapping[Path, BlockChecksums]] = None) -> None:
        """``files``: tensor name -> the file holding it; ``checksums``: as :class:`PiecesSource`'s."""
        super().__init__({k: ((), [StoredPiece(Path(f), k, Placement(k, ()), 0, 0)]) for k, f in files.items()},
                         origin, checksums)

    def shape(self, name: str) -> tuple[int, ...]:
        piece = self._pieces(name)[0]
        return self._file(piece.file).shape(piece.name)

    def read_flat_into(self, name: str, start: int, out: torch.Tensor) -> bool:
        piece = self._pieces(name)[0]
        f = self._file(piece.file)
        if out.device.type != "cpu" or not out.is_contiguous() or f.dtype(piece.name) != out.dtype:
            return False
        f.read_into(piece.name, start, out)
        return True

    def read_box(self, name: str, box: Iterable[slice]) -> torch.Tensor:
        piece = self._pieces(name)[0]
        return self._file(piece.file).read(piece.name, tuple(box))


def entry_source(view: Any) -> PiecesSource:
    """A :class:`PiecesSource` over the tensors of one entry of a :func:`shardwise.checkpoint.save`
    checkpoint (a :class:`~shardwise.checkpoint.door.EntryView`), closed when the load is done."""
    source = PiecesSource.from_metadata({"files": view.files, "tensors": view.tensors}, view.where)
    source.origin = f"{view.where} (entry {view.name!r})"
    return view.adopt(source)
