"""Gradient compression for allreduce (Horovod's ``hvd.Compression``).

A compressor turns a tensor into the one that travels (``compress``) and back
(``decompress``); the context returned by ``compress`` carries what is needed to
undo it. Only floating-point tensors are cast; others travel unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send, and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo :meth:`compress` on the received tensor."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Cast floating-point tensors to ``wire_dtype`` for the trip, back afterwards."""

    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point() and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating-point tensors as float16 (halves traffic; ~3 significant digits)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Send floating-point tensors as bfloat16 (float32's range, ~2 significant digits)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors, named as in Horovod: ``none``, ``fp16`` (and ``bf16``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
