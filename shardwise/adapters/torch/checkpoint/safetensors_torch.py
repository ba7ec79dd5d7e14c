"""Safetensors files read into torch tensors: boxes and element ranges, in the stored dtype."""

from __future__ import annotations

import numpy as np
import torch

from ....checkpoint.safetensors_read import SafetensorsFile
from ....checkpoint.safetensors_stream import DTYPE_SIZES as _SIZES
from ....core.errors import CheckpointError

__all__ = ["TorchSafetensorsFile"]

_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class TorchSafetensorsFile(SafetensorsFile):
    """A :class:`~shardwise.checkpoint.safetensors_read.SafetensorsFile` whose reads give torch tensors."""

    def dtype(self, name: str) -> torch.dtype:
        """The torch dtype of tensor ``name``."""
        return _TORCH[self._entry(name)[0]]

    def _pread_into(self, name: str, out: torch.Tensor, offset: int) -> None:
        """Fill contiguous CPU tensor ``out`` with the file's bytes from ``offset`` on."""
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        self._read_bytes_into(view, offset, f"tensor {name!r} (bytes [{offset}, {offset + view.nbytes}))")

    def read(self, name: str, box: tuple[slice, ...] = ()) -> torch.Tensor:
        """Tensor ``name``, or its ``box`` (one slice per leading dim; steps of 1), as a new torch tensor."""
        dtype, shape, begin, _ = self._entry(name)
        box = tuple(box) + tuple(slice(0, n) for n in shape[len(box):])
        rows = box[0] if shape else slice(0, 1)
        row_elems = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        first, last = rows.indices(shape[0] if shape else 1)[:2]
        last = max(first, last)
        out = torch.empty(((last - first,) + tuple(shape[1:])) if shape else (), dtype=_TORCH[dtype])
        self._pread_into(name, out, self._data + begin + first * row_elems * _SIZES[dtype])
        rest = box[1:]
        if any(s != slice(0, n) for s, n in zip(rest, shape[1:])):
            out = out[(slice(None),) + rest].contiguous()
        return out

    def read_into(self, name: str, first: int, out: torch.Tensor) -> None:
        """Elements ``[first, first + out.numel())`` of tensor ``name`` (row-major) into ``out``,
        a contiguous CPU tensor of the stored dtype."""
        dtype, shape, begin, end = self._entry(name)
        if out.dtype != _TORCH[dtype] or not out.is_contiguous() or out.device.type != "cpu":
            raise CheckpointError(f"{self.path}: tensor {name!r} is {dtype}; cannot read it into a "
                                  f"{out.dtype} {out.device} tensor")
        size = _SIZES[dtype]
        if first < 0 or begin + (first + out.numel()) * size > end:
            raise CheckpointError(f"{self.path}: tensor {name!r} has no elements [{first}, {first + out.numel()})")
        self._pread_into(name, out, self._data + begin + first * size)

