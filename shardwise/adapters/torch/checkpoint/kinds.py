"""The kinds of torch state a checkpoint holds, and how a torch tensor becomes a piece's bytes."""

from __future__ import annotations

from typing import Callable

import torch

from ....core.errors import CheckpointError
from ..parallel.full_tensors import DTYPE_CODES

__all__ = ["MODULE", "OPTIMIZER", "SHARDED_EMBEDDINGS", "SPARSE_OPTIMIZER", "COMBINED_OPTIMIZER", "PARALLEL_MODEL",
           "ZERO_OPTIMIZER",
           "tensor_bytes", "dtype_code"]

MODULE, OPTIMIZER = "torch.module", "torch.optimizer"
SHARDED_EMBEDDINGS, SPARSE_OPTIMIZER = "torch.sharded_embeddings", "torch.sparse_optimizer"
PARALLEL_MODEL = "torch.parallel_model"
COMBINED_OPTIMIZER = "torch.combined_optimizer"
ZERO_OPTIMIZER = "torch.zero_optimizer"


def tensor_bytes(t: torch.Tensor) -> Callable[[], memoryview]:
    """The bytes of ``t`` (C order, on the host), produced when the file is written."""
    def data() -> memoryview:
        flat = t.detach().cpu().contiguous().reshape(-1)
        return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    return data


def dtype_code(key: str, t: torch.Tensor) -> str:
    try:
        return DTYPE_CODES[t.dtype]
    except KeyError:
        raise CheckpointError(f"tensor {key!r} is {t.dtype}, which a checkpoint cannot store") from None


