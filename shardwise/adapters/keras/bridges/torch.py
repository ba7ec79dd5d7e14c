"""The PyTorch bridge: Keras-on-torch tensors go to the communicator as they are.

The ``torch`` backend (gloo, NCCL) and the ``mpi`` backend take torch tensors
directly (CPU tensors without a copy), so gradients never leave torch. Keras runs
the torch train step eagerly unless ``jit_compile=True``; under ``torch.compile``
each collective is a graph break (:func:`~shardwise.adapters.torch.compiling.not_traced`),
so dynamo never traces the communicator's Python.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from ...torch.compiling import not_traced
from .base import Bridge, CommFn

__all__ = ["TorchBridge"]


class TorchBridge(Bridge):
    """Collectives on torch tensors, in program order."""

    name = "torch"

    @not_traced  # under jit_compile=True (torch.compile) a graph break: the collective runs eagerly
    def run(self, fn: CommFn, tensor: Any, shape: Optional[Sequence[int]] = None, after: Any = None) -> Any:
        tensor = torch.as_tensor(tensor).detach()
        out = fn(tensor.contiguous())
        if isinstance(out, np.ndarray):  # a numpy-only backend (tf, single) hands back numpy
            out = torch.from_numpy(out).to(tensor.device)
        return out
