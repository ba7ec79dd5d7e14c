"""What the pipeline executor puts on the wire besides tensors: shape headers, and its two directions."""

from __future__ import annotations

import torch

from ....core.comm import Communicator
from ....core.errors import BackendError, ConfigError

__all__ = ["HEADER_LEN", "duplicate_or_same", "make_header", "read_header"]

#: dtypes an activation header can name (index = code).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8
#: int64 entries of a header: number of dims, dtype code, then the dims (zero-padded).
HEADER_LEN = _MAX_DIMS + 2


def make_header(x: torch.Tensor) -> torch.Tensor:
    """The shape header announcing activation ``x`` to the next stage."""
    if x.dim() > _MAX_DIMS or x.dtype not in _DTYPES:
        raise ConfigError(f"cannot send an activation of shape {tuple(x.shape)} and dtype {x.dtype}; "
                          f"pass activation_shape= or use <= {_MAX_DIMS} dims of {_DTYPES}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = x.dim(), _DTYPES.index(x.dtype)
    header[2:2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    return header


def read_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a header announces."""
    ndim, code = int(header[0]), int(header[1])
    return tuple(header[2:2 + ndim].tolist()), _DTYPES[code]


def duplicate_or_same(comm: Communicator) -> Communicator:
    """``comm.duplicate()``, or ``comm`` where the backend cannot duplicate it (the same on every member)."""
    if comm.size == 1:
        return comm
    try:
        return comm.duplicate()
    except (BackendError, NotImplementedError):
        return comm
