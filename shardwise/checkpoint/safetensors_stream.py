"""Write a safetensors file one tensor at a time, so the writer never holds all of its tensors.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the
bytes. The names, dtypes and shapes are known before any tensor is, so the header
goes first and each tensor's bytes follow as they are produced, in header order.
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO, Mapping, Optional, Sequence

from ..core.errors import CheckpointError

__all__ = ["SafetensorsWriter", "DTYPE_SIZES"]

#: Bytes per element of each safetensors dtype.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1}


class SafetensorsWriter:
    """Streams tensors ``entries`` = ``[(name, dtype, shape), ...]`` into ``f`` in that order."""

    def __init__(self, f: BinaryIO, entries: Sequence[tuple[str, str, Sequence[int]]],
                 metadata: Optional[Mapping[str, str]] = None) -> None:
        self.f = f
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._order: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            if dtype not in DTYPE_SIZES:
                raise CheckpointError(f"{name}: dtype {dtype!r} has no safetensors code")
            if name in header:
                raise CheckpointError(f"tensor {name!r} listed twice")
            numel = 1
            for s in shape:
                numel *= int(s)
            size = numel * DTYPE_SIZES[dtype]
            header[name] = {"dtype": dtype, "shape": [int(s) for s in shape], "data_offsets": [offset, offset + size]}
            self._order.append((name, size))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        self._next = 0

    def write(self, name: str, data: memoryview | bytes) -> None:
        """Append tensor ``name``'s bytes (C order); tensors come in the order of ``entries``."""
        if self._next >= len(self._order):
            raise CheckpointError(f"tensor {name!r} written after the last listed tensor")
        want, size = self._order[self._next]
        if name != want:
            raise CheckpointError(f"tensor {name!r} written where {want!r} was due")
        if memoryview(data).nbytes != size:
            raise CheckpointError(f"tensor {name!r}: {memoryview(data).nbytes} bytes, the header says {size}")
        self.f.write(data)
        self._next += 1

    def close(self) -> None:
        """Check that every listed tensor was written."""
        if self._next != len(self._order):
            raise CheckpointError(f"{len(self._order) - self._next} tensor(s) never written, first "
                                  f"{self._order[self._next][0]!r}")
