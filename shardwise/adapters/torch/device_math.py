"""Gradient norms, non-finite checks and clipping that stay on the gradients' device.

The results are one-element tensors on ``device`` (the device of the tensors they
describe), ready for a collective; reading one as a Python number is the caller's
single host synchronisation of the step. Each group of tensors of one device and
dtype costs a handful of fused ``torch._foreach_*`` kernels, not one kernel per tensor.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

__all__ = ["accumulation_dtype", "squared_norm", "unscale_and_flag", "clip_by_total_norm", "zeros_on"]


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """The dtype sums of squares accumulate in: float64, except where the device has none (MPS)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def zeros_on(device: torch.device, n: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n`` zeros on ``device``: a device-side accumulator or flag."""
    return torch.zeros(n, dtype=dtype, device=device)


def _groups(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def squared_norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of every element of ``tensors``, as a one-element tensor on ``device``."""
    acc = accumulation_dtype(device)
    total = zeros_on(device, 1, acc)
    for (dev, _), group in _groups(t for t in tensors if t.numel()).items():
        norms = torch._foreach_norm(group, 2, dtype=accumulation_dtype(dev))
        total += torch.stack(norms).pow(2).sum().to(device, acc)
    return total


def unscale_and_flag(grads: Sequence[torch.Tensor], scale: float, device: torch.device) -> torch.Tensor:
    """Divide ``grads`` by ``scale`` in place; a one-element float32 tensor on ``device``: 1 if any is non-finite.

    Uses the kernel ``torch.amp.GradScaler`` uses (one fused pass per device and dtype,
    multiplying by ``1 / scale``: the same as dividing for the power-of-two scales of
    dynamic loss scaling).
    """
    flag = zeros_on(device)
    for (dev, _), group in _groups(grads).items():
        found = flag if dev == flag.device else zeros_on(dev)
        inv = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        if found is not flag:
            flag = torch.maximum(flag, found.to(device))
    return flag


def clip_by_total_norm(tensors: Sequence[torch.Tensor], total_squares: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale ``tensors`` in place so that their norm, ``sqrt(total_squares)``, is at most ``max_norm``.

    No host synchronisation: the factor ``min(1, max_norm / (norm + 1e-6))`` stays on the
    device (as in ``torch.nn.utils.clip_grad_norm_``). Returns the norm (a device tensor).
    """
    total = total_squares.reshape(()).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for (dev, dtype), group in _groups(t for t in tensors if t.numel()).items():
        torch._foreach_mul_(group, coef.to(dev, dtype))
    return total
