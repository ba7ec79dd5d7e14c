"""Host-memory views of numpy arrays and torch tensors for engines that speak numpy.

The ``mpi`` and ``local`` backends move bytes through numpy views so that CPU
tensors are never copied; CUDA tensors are staged through pinned host buffers
(:mod:`._device_staging`). Torch is imported lazily and only when a torch tensor
is actually passed in.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..core.errors import ShapeMismatchError
from . import _device_staging as _staging

BFLOAT16 = "bfloat16"


def is_torch(x: Any) -> bool:
    """True when ``x`` is a torch tensor (without importing torch)."""
    return type(x).__module__.startswith("torch")


@dataclass
class HostView:
    """A contiguous numpy view of a tensor, plus how to publish changes back to it.

    ``array`` shares memory with the original whenever possible. bfloat16 data,
    which numpy lacks, is viewed as raw ``uint16`` bits with ``logical`` set to
    ``"bfloat16"``. ``writeback`` is set when the view is a copy (non-contiguous or
    device tensors) and must be called after the view was modified.
    """

    array: np.ndarray
    logical: str
    writeback: Optional[Callable[[], None]] = None

    def publish(self) -> None:
        if self.writeback is not None:
            self.writeback()


def host_view(x: Any) -> HostView:
    """Return a :class:`HostView` of a numpy array or torch tensor."""
    if isinstance(x, np.ndarray):
        if x.flags.c_contiguous and x.flags.writeable:
            return HostView(x, x.dtype.name)
        buf = np.ascontiguousarray(x)

        def _back(orig: np.ndarray = x, b: np.ndarray = buf) -> None:
            if orig.flags.writeable:
                orig[...] = b

        return HostView(buf, x.dtype.name, _back)
    if is_torch(x):
        return _torch_view(x)
    if np.isscalar(x):
        arr = np.asarray(x)
        return HostView(arr.reshape(()).copy(), arr.dtype.name)
    raise TypeError(f"unsupported tensor type {type(x).__name__}; pass a numpy array or a torch tensor")


def _torch_view(t: Any) -> HostView:
    import torch

    src = t.detach()
    on_host = src.device.type == "cpu"
    contiguous = src.is_contiguous()
    cuda = _staging.is_cuda(src)
    if on_host and contiguous:
        work = src
    else:
        work = _staging.to_host(src) if cuda else src.contiguous().cpu()
    if work.dtype == torch.bfloat16:
        arr = _numpy_of(work.view(torch.int16)).view(np.uint16)
        logical = BFLOAT16
    else:
        arr = _numpy_of(work)
        logical = arr.dtype.name
    if on_host and contiguous:
        return HostView(arr, logical)

    def _back(dst: Any = src, w: Any = work) -> None:
        if cuda:
            _staging.to_device(w, dst)
        else:
            dst.copy_(w.to(dst.device))

    return HostView(arr, logical, _back)


def _numpy_of(t: Any) -> np.ndarray:
    """``t.numpy()`` for a contiguous host tensor, except that ``t``'s storage stays resizable.

    ``Tensor.numpy()`` marks the storage as not resizable for good; ZeRO-3 frees a unit's
    gathered parameters by resizing their storage to nothing. The array keeps ``t`` alive,
    as ``numpy()``'s does.
    """
    if t.numel() == 0 or not t.is_contiguous():
        return t.numpy()
    raw = (ctypes.c_byte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    raw._owner = t  # type: ignore[attr-defined]
    return np.frombuffer(raw, dtype=t.new_empty(0).numpy().dtype).reshape(tuple(t.shape))


def empty_like_host(x: Any, shape: tuple[int, ...]) -> tuple[Any, HostView]:
    """A new tensor of ``x``'s kind, dtype and device with ``shape``, and its host view."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        out = np.empty(shape, dtype=np.asarray(x).dtype)
        return out, HostView(out, out.dtype.name)
    if is_torch(x):
        from .host_buffers import empty

        cuda = _staging.is_cuda(x)
        out = _staging.pinned_empty(shape, x.dtype) if cuda else empty(shape, x.dtype, "cpu")
        view = _torch_view(out)
        if x.device.type != "cpu":
            host = out

            def _finish() -> Any:
                return _staging.new_on_device(host, x.device) if cuda else host.to(x.device)

            view.writeback = None
            return _DeviceResult(out, _finish), view
        return out, view
    raise TypeError(f"unsupported tensor type {type(x).__name__}")


class _DeviceResult:
    """A host tensor that must be moved to the caller's device once filled."""

    def __init__(self, host: Any, finish: Callable[[], Any]) -> None:
        self.host = host
        self.finish = finish


def finalize(out: Any) -> Any:
    """Turn an output made by :func:`empty_like_host` into what the caller receives."""
    return out.finish() if isinstance(out, _DeviceResult) else out


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def dtype_name(x: Any) -> str:
    """A framework-neutral dtype name (``float32``, ``bfloat16``, ...)."""
    if isinstance(x, np.ndarray):
        return x.dtype.name
    if is_torch(x):
        return str(x.dtype).replace("torch.", "")
    return np.asarray(x).dtype.name


# -- bfloat16 <-> float32 on raw bits (round to nearest even) -------------------------
def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(values: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = 0x7FC0
    if out is not None:
        out[...] = rounded.reshape(out.shape)
        return out
    return rounded


def alltoall_rows(shape: tuple[int, ...], splits: Optional[Sequence[int]], size: int) -> list[int]:
    """Rows of a tensor of ``shape`` that an alltoall sends to each of ``size`` ranks: ``splits``, checked,
    or else dim 0 in equal parts."""
    if not shape:
        raise ShapeMismatchError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        if shape[0] % size:
            raise ShapeMismatchError(f"alltoall: dim 0 ({shape[0]}) is not divisible by the group size ({size}); "
                                     "pass splits=")
        return [shape[0] // size] * size
    rows = [int(s) for s in splits]
    check_first_dim_split(shape, rows, size, "alltoall")
    return rows


def check_first_dim_split(shape: tuple[int, ...], splits: list[int], size: int, what: str) -> None:
    if len(splits) != size:
        raise ShapeMismatchError(f"{what}: expected {size} split sizes (one per rank), got {len(splits)}")
    if any(s < 0 for s in splits):
        raise ShapeMismatchError(f"{what}: split sizes must be non-negative, got {splits}")
    first = shape[0] if shape else 0
    if sum(splits) != first:
        raise ShapeMismatchError(f"{what}: split sizes {splits} sum to {sum(splits)} but dim 0 is {first}")
