"""``SyncBatchNorm``: batch normalisation with statistics over the global batch of all ranks.

Forward allreduces (per channel) the sum, the sum of squares and the count, so
every rank normalises with the mean and variance of the whole global batch.
Backward allreduces the per-channel sums of ``dy`` and ``dy * (x - mean)``, which
makes the input gradient that of single-process BatchNorm on the global batch;
weight and bias gradients stay local and are averaged with the other gradients.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from shardwise.core.comm import Communicator

from .compiling import not_traced
from .ops import Sum
from ..horovod.process_sets import ProcessSet, comm_of, global_process_set

__all__ = ["SyncBatchNorm"]


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype in (torch.float16, torch.bfloat16, torch.float32) else x.dtype


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], eps: float,
                momentum: float, comm: Communicator) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        acc = _stats_dtype(x)
        count = x.numel() // channels
        stats = torch.cat([x.sum(dims, dtype=acc), (x.to(acc) ** 2).sum(dims),
                           torch.tensor([float(count)], dtype=acc, device=x.device)])
        stats = comm.allreduce(stats, Sum, inplace=True)
        total = float(stats[-1])
        if total <= 1:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel over the global batch, "
                             f"got {int(total)}")
        mean = stats[:channels] / total
        var = (stats[channels:2 * channels] / total - mean * mean).clamp_(min=0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * (total / (total - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        mean_c, invstd_c = mean.to(x.dtype).view(shape), invstd.to(x.dtype).view(shape)
        xhat = (x - mean_c) * invstd_c
        ctx.save_for_backward(xhat, invstd_c, weight)
        ctx.comm, ctx.total, ctx.dims = comm, total, dims
        out = xhat * weight.view(shape) if weight is not None else xhat
        return out + bias.view(shape) if bias is not None else out

    @staticmethod
    @not_traced
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        xhat, invstd, weight = ctx.saved_tensors
        dims, channels = ctx.dims, xhat.shape[1]
        shape = [1, channels] + [1] * (xhat.dim() - 2)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_weight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            both = ctx.comm.allreduce(torch.cat([sum_dy, sum_dy_xhat]), Sum, inplace=True)
            mean_dy = (both[:channels] / ctx.total).view(shape)
            mean_dy_xhat = (both[channels:] / ctx.total).view(shape)
            scale = invstd * weight.view(shape) if weight is not None else invstd
            grad_x = (dy - mean_dy - xhat * mean_dy_xhat) * scale
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover every rank of ``process_set``.

    Takes input ``(N, C)`` or ``(N, C, ...)``; in eval mode (or on one rank) it
    is plain batch norm. The state dict is that of ``nn.BatchNorm*d``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set, device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of shape (N, C, ...), got {tuple(x.shape)}")

    @not_traced  # collectives: a compiled model breaks its graph here and runs this eagerly
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise with global-batch statistics in training, running statistics in eval."""
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got {x.shape[1]} channels")
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        running_mean = self.running_mean if keep else None
        running_var = self.running_var if keep else None
        comm = comm_of(self.process_set) if bn_training else None
        if comm is None or comm.size == 1:
            return F.batch_norm(x, running_mean, running_var, self.weight, self.bias, bn_training,
                                momentum, self.eps)
        return _SyncBatchNormFn.apply(x, self.weight, self.bias, running_mean, running_var, self.eps,
                                      momentum, comm)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: ProcessSet = global_process_set) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` by a :class:`SyncBatchNorm` with the same state."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight, out.bias = module.weight, module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out
