"""``DistributedDataParallel``: a module wrapper whose backward leaves averaged gradients.

The wrapper and :class:`~shardwise.adapters.torch.optimizer.DistributedOptimizer`
share one mechanism, :class:`GradientSynchronizer` (bucketed allreduce started
from gradient hooks). Here the synchronisation completes at the end of each
backward pass, as in ``torch.nn.parallel.DistributedDataParallel``; inside
:meth:`DistributedDataParallel.no_sync` gradients only accumulate locally.
The wrapper compiles either way round: ``torch.compile(DistributedDataParallel(m))``
(the buffer broadcast runs between graphs) or ``DistributedDataParallel(torch.compile(m))``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from shardwise.core.buckets import DEFAULT_BUCKET_CAP_BYTES
from shardwise.core.errors import ConfigError

from .compiling import not_traced
from .compression import Compression, Compressor
from .functions import broadcast_parameters, broadcast_tensors
from .grad_sync import GradientSynchronizer, ModelMismatchError, agree_parameters
from .ops import Average
from ..horovod.process_sets import ProcessSet, comm_of, global_process_set

__all__ = ["DistributedDataParallel", "GradientSynchronizer", "ModelMismatchError", "agree_parameters"]


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` for data parallelism over ``process_set`` (collective to build).

    At construction rank 0's parameters and buffers are copied to every rank.
    After each ``backward()`` (outside :meth:`no_sync`) every parameter's
    ``.grad`` holds the average over ranks. Parameters unused in a forward pass
    are handled (they contribute zeros); frozen parameters are left alone.
    ``gradient_as_bucket_view`` (default True here, False in torch) keeps each
    ``.grad`` as a view of its bucket, so gradients are stored once.
    ``find_unused_parameters``, ``device_ids`` and ``output_device`` are accepted
    for compatibility with torch's class and ignored.
    """

    def __init__(self, module: torch.nn.Module, *, process_set: ProcessSet = global_process_set,
                 bucket_cap_mb: Optional[float] = None, bucket_cap_bytes: Optional[int] = None,
                 broadcast_buffers: bool = True, compression: type[Compressor] = Compression.none,
                 op: Any = Average, gradient_predivide_factor: float = 1.0, init_sync: bool = True,
                 find_unused_parameters: bool = True, device_ids: Optional[list] = None,
                 output_device: Any = None, gradient_as_bucket_view: bool = True) -> None:
        super().__init__()
        if bucket_cap_mb is not None and bucket_cap_bytes is not None:
            raise ConfigError("pass bucket_cap_mb or bucket_cap_bytes, not both")
        cap = DEFAULT_BUCKET_CAP_BYTES
        if bucket_cap_mb is not None:
            cap = int(bucket_cap_mb * 1024 * 1024)
        elif bucket_cap_bytes is not None:
            cap = int(bucket_cap_bytes)
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        comm = comm_of(process_set)
        self._comm = comm
        if init_sync:
            broadcast_parameters(module.state_dict(), 0, comm)
        self._synchronizer = GradientSynchronizer(
            module.named_parameters(), comm, op=op, compression=compression, bucket_cap_bytes=cap,
            gradient_predivide_factor=gradient_predivide_factor, finalize_on_backward=True,
            gradient_as_bucket_view=gradient_as_bucket_view)

    @property
    def synchronizer(self) -> GradientSynchronizer:
        """The gradient synchroniser (bucket layout, hooks)."""
        return self._synchronizer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (after copying rank 0's buffers when ``broadcast_buffers``)."""
        if self.broadcast_buffers and self.training and self._comm.size > 1:
            self._broadcast_buffers()
        return self.module(*args, **kwargs)

    @not_traced  # a collective: compiled around, the forward breaks its graph here
    def _broadcast_buffers(self) -> None:
        buffers = list(self.module.buffers())
        if buffers:
            broadcast_tensors(buffers, 0, self._comm)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block, backward passes accumulate gradients locally without communicating.

        The first backward after the block averages the accumulated gradients.
        """
        previous = self._synchronizer.enabled
        self._synchronizer.enabled = False
        try:
            yield
        finally:
            self._synchronizer.enabled = previous
