"""torch tensors as plain data (:mod:`shardwise.checkpoint.plain_state`): their raw bytes, dtype and shape.

:data:`TORCH_CODEC` stores any dense tensor (float32/64, bfloat16, float16, the float8
kinds, integers, bool, complex) from any device: a CUDA tensor is copied to the CPU,
and every tensor is loaded back on the CPU as a plain tensor (an ``nn.Parameter``
comes back as a tensor, without ``requires_grad``). Sparse, quantized, meta tensors
and other tensor subclasses (``DTensor``, ...) are refused.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...checkpoint.plain_state import TensorCodec
from ...core.errors import CheckpointError, ConfigError

__all__ = ["TORCH_CODEC"]


def _check(tensor: Any) -> None:
    """ConfigError for a tensor that is not stored: a subclass, not dense, quantized, on the meta device."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise ConfigError(f"a tensor of subclass {type(tensor).__qualname__} is not plain data (store a plain "
                          "tensor, e.g. its full_tensor() or to_local())")
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise ConfigError(f"a {'quantized' if tensor.is_quantized else tensor.layout} tensor: only dense tensors "
                          "are plain data")
    if tensor.device.type == "meta":
        raise ConfigError("a tensor on the meta device has no values to store")


def _to_bytes(tensor: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """A dense torch tensor as ``(dtype name, shape, bytes in C order)``, copied to the CPU when elsewhere."""
    _check(tensor)
    flat = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy()
    return str(tensor.dtype).removeprefix("torch."), tuple(int(s) for s in tensor.shape), memoryview(raw)


def _from_bytes(dtype: str, shape: tuple[int, ...], buffer: memoryview) -> torch.Tensor:
    """The CPU tensor of ``dtype`` (a torch dtype's name) and ``shape`` whose bytes are ``buffer`` (copied)."""
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise CheckpointError(f"{dtype!r} is not a torch dtype")
    out = torch.empty(shape, dtype=kind)
    want = out.element_size() * math.prod(shape)
    if buffer.nbytes != want:
        raise CheckpointError(f"{buffer.nbytes} bytes for a {dtype} tensor of shape {list(shape)} ({want} bytes)")
    if want:
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(buffer, dtype=np.uint8)
    return out


#: torch tensors: any dense dtype, any device on save, the CPU on load.
TORCH_CODEC = TensorCodec("torch", torch.is_tensor, _to_bytes, _from_bytes, _check)
