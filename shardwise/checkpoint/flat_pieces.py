"""Flat element ranges of a ``shardwise-state`` checkpoint's tensors, read with numpy only (no framework).

The door (:mod:`.door`) stores each piece a rank held as a 1-D safetensors tensor and
lists it in the manifest's tensor table as ``[file, stored name, placement, start,
stop]``. Where every piece of a tensor is whole-tensor placed (no tensor-parallel
slice), ``[start, stop)`` counts in the whole tensor's row-major elements, and
:class:`FlatPiecesReader` answers "elements ``[a, b)`` of tensor ``key``" from the
pieces that overlap them, so a checkpoint written on N ranks loads on any number of
ranks and any partition layout. It answers :class:`~.flat.FlatReader`'s calls
(``read``, ``read_whole``, ``read_into``, ``has``, ``close``), so code loading a flat
checkpoint reads either. Every file is opened with its block checksums from the
manifest: each read checks the blocks it touches (:mod:`.blocks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ..core.errors import CheckpointError
from .blocks import BlockChecksums
from .manifest import read_manifest
from .safetensors_read import SafetensorsFile, open_checked

__all__ = ["WHOLE_PLACEMENT", "FlatStoredPiece", "FlatStoredTensor", "FlatPiecesReader", "numpy_dtype",
           "safetensors_code"]

#: The JSON placement (:func:`~.pieces.encode_placement`'s form) of a piece counted in the whole tensor's elements.
WHOLE_PLACEMENT = (None, 1, 1, 0, False, None, False)

_NUMPY = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32", "I16": "int16",
          "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_CODES = {np.dtype(v): k for k, v in _NUMPY.items()}


def numpy_dtype(code: str) -> np.dtype:
    """The numpy dtype of safetensors dtype ``code`` (``BF16`` needs ``ml_dtypes``)."""
    if code == "BF16":
        try:
            import ml_dtypes
        except ImportError:
            raise CheckpointError("a BF16 tensor needs the ml_dtypes package to be read with numpy") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(_NUMPY[code])
    except KeyError:
        raise CheckpointError(f"unknown safetensors dtype {code!r}") from None


def safetensors_code(dtype: Any) -> str:
    """The safetensors dtype code of numpy dtype ``dtype``; CheckpointError for one it has none for."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return "BF16"
    try:
        return _CODES[dtype]
    except KeyError:
        raise CheckpointError(f"numpy dtype {dtype} has no safetensors code (a checkpoint stores "
                              f"{', '.join(sorted(set(_NUMPY.values())))} and bfloat16)") from None


@dataclass(frozen=True)
class FlatStoredPiece:
    """Elements ``[start, stop)`` of a whole tensor, stored 1-D as tensor ``name`` of ``file``."""

    file: Path
    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class FlatStoredTensor:
    """A tensor's whole shape, its stored dtype code and the pieces that hold it (sorted by start)."""

    shape: tuple[int, ...]
    code: str
    pieces: tuple[FlatStoredPiece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _is_whole(placement: Any) -> bool:
    """Whether a piece's JSON placement (:func:`~.pieces.encode_placement`'s form) is the whole tensor."""
    if placement is None:
        return True
    if not isinstance(placement, (list, tuple)) or len(placement) < 5:
        raise CheckpointError(f"malformed placement {placement!r}")
    return placement[0] is None and not placement[4]


class FlatPiecesReader:
    """Element ranges of a checkpoint's tensors, read with numpy from the safetensors pieces holding them.

    ``tensors``: key -> :class:`FlatStoredTensor`; ``declared``: key -> shape of tensors
    that may have no stored piece (no elements); ``checksums``: file -> its block
    checksums, which every read from that file checks.
    """

    def __init__(self, tensors: Mapping[str, FlatStoredTensor], origin: str,
                 checksums: Optional[Mapping[Path, BlockChecksums]] = None,
                 declared: Optional[Mapping[str, Sequence[int]]] = None) -> None:
        self.tensors = dict(tensors)
        for key, shape in (declared or {}).items():
            shape = tuple(int(d) for d in shape)
            if key not in self.tensors and math.prod(shape) == 0:
                self.tensors[key] = FlatStoredTensor(shape, "F32", ())
        self.origin = origin
        self._checksums = dict(checksums or {})
        self._handles: dict[Path, SafetensorsFile] = {}

    @classmethod
    def from_table(cls, files: Sequence[str], tensors: Mapping[str, Mapping[str, Any]], where: Path,
                   origin: Optional[str] = None,
                   declared: Optional[Mapping[str, Sequence[int]]] = None) -> "FlatPiecesReader":
        """The tensors of the door's tensor table ``tensors`` (names without their entry's prefix) over the
        checkpoint's ``files`` in directory ``where``, checked against the block checksums its manifest records.
        Refuses a tensor with a tensor-parallel piece (its ranges count in the slice, not the whole tensor)."""
        where = Path(where)
        paths = [where / str(f) for f in files]
        table: dict[str, FlatStoredTensor] = {}
        try:
            for key, info in tensors.items():
                pieces = []
                for f, name, placement, start, stop in info["pieces"]:
                    if not _is_whole(placement):
                        raise CheckpointError(f"{origin or where}: tensor {key!r} is stored as tensor-parallel "
                                              "slices, which have no whole-tensor element ranges to read flat")
                    pieces.append(FlatStoredPiece(paths[int(f)], str(name), int(start), int(stop)))
                table[key] = FlatStoredTensor(tuple(int(s) for s in info["shape"]), str(info["dtype"]),
                                              tuple(sorted(pieces, key=lambda p: (p.start, -p.stop))))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{origin or where}: the manifest's tensor table is malformed ({exc!r})") from None
        checksums = {where / name: blocks for name, entry in read_manifest(where).files.items()
                     if (blocks := entry.blocks) is not None}
        return cls(table, origin or str(where), checksums, declared)

    def has(self, key: str) -> bool:
        return key in self.tensors

    def tensor(self, key: str) -> FlatStoredTensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError(f"{self.origin} has no tensor {key!r}") from None

    def _file(self, path: Path) -> SafetensorsFile:
        return open_checked(self._handles, path, self._checksums.get(path), self.origin)

    def _segments(self, key: str, start: int, stop: int) -> list[tuple[FlatStoredPiece, int, int]]:
        """``(piece, lo, hi)``: the stored pieces that make up elements ``[start, stop)`` of ``key``, in order."""
        info = self.tensor(key)
        if not 0 <= start <= stop <= info.numel:
            raise CheckpointError(f"{self.origin}: range [{start}, {stop}) is outside tensor {key!r} "
                                  f"of {info.numel} elements")
        out: list[tuple[FlatStoredPiece, int, int]] = []
        at = start
        while at < stop:
            covering = [p for p in info.pieces if p.start <= at < p.stop]
            if not covering:
                raise CheckpointError(f"{self.origin}: tensor {key!r}: its pieces cover elements [{start}, {at}) "
                                      f"of the [{start}, {stop}) asked for (a damaged checkpoint)")
            piece = max(covering, key=lambda p: p.stop)
            hi = min(piece.stop, stop)
            out.append((piece, at, hi))
            at = hi
        return out

    def _fill(self, key: str, piece: FlatStoredPiece, lo: int, out: np.ndarray) -> None:
        """Elements ``[lo, lo + out.size)`` of ``key`` from ``piece`` into 1-D ``out`` (cast if it differs)."""
        f = self._file(piece.file)
        stored = numpy_dtype(f.code(piece.name))
        if out.dtype == stored and out.flags.c_contiguous:
            f.read_elements_into(piece.name, lo - piece.start, out)
            return
        values = np.empty(out.size, stored)
        f.read_elements_into(piece.name, lo - piece.start, values)
        out[...] = values

    def read(self, key: str, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Elements ``[start, stop)`` of tensor ``key`` (1-D, in the stored dtype)."""
        info = self.tensor(key)
        stop = info.numel if stop is None else stop
        segments = self._segments(key, start, stop)
        out = np.empty(stop - start, numpy_dtype(info.code))
        for piece, lo, hi in segments:
            self._fill(key, piece, lo, out[lo - start:hi - start])
        return out

    def read_whole(self, key: str) -> np.ndarray:
        """Tensor ``key`` in its shape."""
        return self.read(key).reshape(self.tensor(key).shape)

    def read_into(self, out: np.ndarray, ranges: Iterable[tuple[str, int, int, int]]) -> np.ndarray:
        """Fill 1-D ``out``: for each ``(key, start, out_offset, length)`` copy elements
        ``[start, start + length)`` of ``key`` to ``out[out_offset:]``, read straight into it where the dtypes
        agree."""
        for key, start, offset, length in ranges:
            for piece, lo, hi in self._segments(key, start, start + length):
                self._fill(key, piece, lo, out[offset + lo - start:offset + hi - start])
        return out

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
