"""Read boxes of tensors from a safetensors file with plain reads, not a memory map.

``safe_open`` maps the whole file: every page a rank touches counts in its resident set
until the file is closed, so reading a rank's slices of a 600 MiB checkpoint through it
shows up as hundreds of MiB per rank. Here each read copies only the bytes of the rows a
box covers (one ``pread`` per box when it spans whole rows, else the covering rows, cut).
The header is parsed and checked when the file is opened: a truncated or foreign file
fails with its name. Opened with the file's block checksums (a checkpoint's manifest
entry), every read, the header's included, checks the blocks it touches
(:class:`~.blocks.VerifiedReader`), so damage in what a rank reads fails there with the
file, the block and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..core.errors import CheckpointError
from .blocks import BlockChecksums, VerifiedReader, preadv_exact
from .safetensors_stream import DTYPE_SIZES as _SIZES

__all__ = ["SafetensorsFile", "open_checked"]

_MAX_HEADER = 100 << 20


class SafetensorsFile:
    """An open safetensors file: names, shapes, dtype codes, and element reads into numpy arrays (the torch
    adapter's :class:`~shardwise.adapters.torch.checkpoint.safetensors_torch.TorchSafetensorsFile` reads
    boxes into torch tensors).

    With ``checksums`` (the file's expected size and block CRC-32s), every byte read is
    checked against them first; a mismatch raises :class:`CheckpointError`.
    """

    def __init__(self, path: Path, checksums: Optional[BlockChecksums] = None) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot be opened ({exc.strerror})") from None
        self._verified: Optional[VerifiedReader] = None
        try:
            if checksums is not None:
                size = os.fstat(self._fd).st_size
                if size != checksums.size:
                    raise CheckpointError(f"{self.path}: {size} bytes, the manifest says {checksums.size} bytes "
                                          "(a damaged or truncated checkpoint)")
                self._verified = VerifiedReader(self._fd, self.path, checksums)
            self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise CheckpointError(f"{self.path}: cannot be read as safetensors (a file of {size} bytes)")
        head = self._pread(8, 0, "the header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{self.path}: cannot be read as safetensors (header of {length} bytes in a "
                                  f"file of {size})")
        try:
            header = json.loads(self._pread(length, 8, "the header"))
        except ValueError as exc:
            raise CheckpointError(f"{self.path}: cannot be read as safetensors (header: {exc})") from None
        header.pop("__metadata__", None)
        self._data = 8 + length
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], tuple(int(s) for s in info["shape"])
            if dtype not in _SIZES or end - begin != _SIZES[dtype] * int(np.prod(shape, dtype=np.int64)):
                raise CheckpointError(f"{self.path}: tensor {name!r} has a bad header entry {info}")
            if self._data + end > size:
                raise CheckpointError(f"{self.path}: truncated: tensor {name!r} ends at byte {self._data + end}, "
                                      f"the file has {size} bytes")
            self._entries[name] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def _entry(self, name: str) -> tuple[str, tuple[int, ...], int, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path} has no tensor {name!r}") from None

    def _read_bytes_into(self, view: memoryview, offset: int, what: str) -> None:
        """Fill byte view ``view`` with the file's bytes from ``offset`` on (checked, with checksums)."""
        if self._verified is not None:
            self._verified.read_into(view, offset, what)
        else:
            preadv_exact(self._fd, [view], offset, self.path, what)

    def _pread(self, n: int, offset: int, what: str) -> bytes:
        buffer = bytearray(n)
        self._read_bytes_into(memoryview(buffer), offset, what)
        return bytes(buffer)

    def code(self, name: str) -> str:
        """The safetensors dtype code (``"F32"``, ``"I64"``, ...) of tensor ``name``."""
        return self._entry(name)[0]

    def read_elements_into(self, name: str, first: int, out: np.ndarray) -> None:
        """Elements ``[first, first + out.size)`` of tensor ``name`` (row-major) into ``out``, a C-contiguous
        numpy array whose itemsize is the stored dtype's (numpy only: no framework is imported)."""
        dtype, _, begin, end = self._entry(name)
        size = _SIZES[dtype]
        if not out.flags.c_contiguous or out.itemsize != size:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {dtype}; cannot read it into a "
                                  f"{out.dtype} array{'' if out.flags.c_contiguous else ' (not contiguous)'}")
        if first < 0 or begin + (first + out.size) * size > end:
            raise CheckpointError(f"{self.path}: tensor {name!r} has no elements [{first}, {first + out.size})")
        offset = self._data + begin + first * size
        view = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        self._read_bytes_into(view, offset, f"tensor {name!r} (bytes [{offset}, {offset + view.nbytes}))")

    def close(self) -> None:
        if self._verified is not None:
            self._verified.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_checked(handles: dict, path: Path, checksums: Any, origin: str,
                 opener: type = SafetensorsFile) -> "SafetensorsFile":
    """``handles[path]``, opening it first as ``opener`` (with its block ``checksums``, or None) if this
    reader has not; a missing file is a :class:`CheckpointError` naming ``origin``."""
    handle = handles.get(path)
    if handle is None:
        if not path.is_file():
            raise CheckpointError(f"{origin}: file {path.name} is missing")
        handle = handles[path] = opener(path, checksums)
    return handle
