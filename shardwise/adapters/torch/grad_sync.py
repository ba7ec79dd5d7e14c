"""The gradient synchronisation shared by :class:`DistributedOptimizer` and :class:`DistributedDataParallel`.

Post-accumulate-grad hooks count each parameter's backward passes; when every
parameter of a bucket (``core.plan_buckets``) has its gradient, an asynchronous
in-place allreduce of the bucket's flat buffer starts, so communication overlaps
the rest of backward. Buckets are always issued in bucket order, so every rank
issues the same collectives in the same order even when their backward passes differ.

As with DDP's ``gradient_as_bucket_view``, each dense gradient lives in its
bucket: the first time a gradient arrives as a tensor of its own (the first step,
or after ``zero_grad(set_to_none=True)``) it is copied in and ``.grad`` becomes a
view of the bucket, so later backward passes accumulate straight into the buffer
and there is one copy of the gradients, not two. A bucket that holds a single
parameter (one larger than the cap, or than ``solo_bytes``) has no buffer at all:
the gradient tensor itself is reduced in place, so large gradients are never
copied, whether they are fresh tensors or kept from step to step. Buckets start in reverse
registration order; at the end of the first step they are re-planned once in the
order rank 0's gradients became ready (as DDP rebuilds its buckets), so the first
bucket is complete as early as possible.

:meth:`GradientSynchronizer.synchronize` issues the buckets still waiting
(parameters without a gradient contribute zeros) and waits. A parameter whose
gradient is ``None`` on every rank keeps ``None`` (as in single-process training);
if any rank has one, all get the result. Which ranks had which gradient travels at
the end of the last bucket, so a step costs one collective per bucket and nothing more.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch

from shardwise.core.buckets import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_SOLO_BYTES, plan_buckets
from shardwise.core.comm import Communicator, Handle, ReduceOp
from shardwise.core.errors import ConfigError, ShardwiseError

from .compiling import not_traced
from .compression import Compression, Compressor
from .ops import Average, resolve_op
from .param_agree import ModelMismatchError, agree_parameters, dtype_name

__all__ = ["GradientSynchronizer", "ModelMismatchError", "agree_parameters", "dtype_name", "travels_as_is"]


def travels_as_is(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """True when ``grad`` can be reduced in its own storage: dense, contiguous, of the parameter's dtype."""
    return grad.layout == torch.strided and grad.is_contiguous() and grad.dtype == param.dtype


class GradientSynchronizer:
    """Bucketed, overlapped gradient allreduce for a list of named parameters (collective to build).

    ``gradient_as_bucket_view`` (default True) keeps each dense gradient in its bucket;
    ``rebuild_buckets`` (default True) re-plans the buckets once, after the first
    step, in the order gradients became ready on rank 0. A parameter of at least
    ``solo_bytes`` (default :data:`~shardwise.core.buckets.DEFAULT_SOLO_BYTES`; None:
    only those larger than the cap) gets a bucket of its own and is reduced in place.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], comm: Communicator, *,
                 op: Any = Average, compression: type[Compressor] = Compression.none,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, backward_passes_per_step: int = 1,
                 gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                 finalize_on_backward: bool = False, gradient_as_bucket_view: bool = True,
                 rebuild_buckets: bool = True, solo_bytes: Optional[int] = DEFAULT_SOLO_BYTES) -> None:
        self.op = resolve_op(op)
        if not isinstance(self.op, ReduceOp):
            raise NotImplementedError("gradient synchronisation with op=Adasum (Horovod's delta optimizer) is not "
                                      "supported; use op=hvd.Average or hvd.Sum, or hvd.allreduce(t, op=hvd.Adasum)")
        if int(backward_passes_per_step) < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if gradient_predivide_factor != 1.0 and self.op is not Average:
            raise ConfigError("gradient_predivide_factor is only supported with op=Average")
        self.comm, self.compression = comm, compression
        self.passes_per_step = int(backward_passes_per_step)
        self.predivide = float(gradient_predivide_factor)
        self.average_aggregated = bool(average_aggregated_gradients)
        self.finalize_on_backward = finalize_on_backward
        self.as_bucket_view = bool(gradient_as_bucket_view)
        self.cap_bytes = int(bucket_cap_bytes)
        self.solo_bytes = None if solo_bytes is None else int(solo_bytes)
        #: When False (``no_sync``), hooks do nothing and gradients accumulate locally.
        self.enabled = True
        named, seen = [], set()
        for name, p in named_parameters:
            if p.requires_grad and id(p) not in seen:  # frozen excluded, shared counted once
                seen.add(id(p))
                named.append((str(name), p))
        entries = [(n, tuple(p.shape), dtype_name(p)) for n, p in named]
        order = agree_parameters(comm, entries)
        self.names = [named[i][0] for i in order]
        self.params = [named[i][1] for i in order]
        self._buffers: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self._install_plan(None)
        self._rebuild_enabled = self._rebuild_pending = bool(rebuild_buckets)
        device = self.params[0].device if self.params else torch.device("cpu")
        self._present = torch.zeros(len(self.params), dtype=torch.float32, device=device)
        self._lock = threading.RLock()
        me = weakref.ref(self)
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(me, i))
                              for i, p in enumerate(self.params)]
        self._reset()

    def _install_plan(self, order: Optional[Sequence[int]]) -> None:
        """Plan the buckets in ``order`` (default: reverse registration), moving gradients that live in them."""
        self.plan = plan_buckets([p.numel() for p in self.params], [dtype_name(p) for p in self.params],
                                 [p.element_size() for p in self.params], self.cap_bytes, order=order,
                                 solo_bytes=self.solo_bytes)
        self._where = self.plan.bucket_of()
        # With a sum or an average, which ranks had each gradient rides at the end of the last
        # bucket (a positive sum means at least one): no extra collective per step.
        self._piggyback = bool(self.plan.buckets) and self.op in (ReduceOp.SUM, ReduceOp.AVERAGE)
        last = len(self.plan.buckets) - 1
        # A one-parameter bucket reduces the gradient tensor itself; the last bucket keeps a
        # buffer when the presence flags ride on it.
        self._solo = [len(b.params) == 1 and not (self._piggyback and k == last)
                      for k, b in enumerate(self.plan.buckets)]
        old_views = self._views
        self._buffers = [torch.empty(0, device=self.params[b.params[0]].device) if solo else
                         torch.zeros(b.numel + (len(self.params) if self._piggyback and k == last else 0),
                                     dtype=self.params[b.params[0]].dtype, device=self.params[b.params[0]].device)
                         for k, (b, solo) in enumerate(zip(self.plan.buckets, self._solo))]
        self._views = [torch.empty(0, device=p.device) for p in self.params]
        for b, bucket in enumerate(self.plan.buckets):
            if self._solo[b]:
                continue
            for i, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
                self._views[i] = self._buffers[b][off:off + n].view(self.params[i].shape)
        with torch.no_grad():  # kept gradients move to where the new plan keeps them
            for p, old, new in zip(self.params, old_views, self._views):
                grad = p.grad
                if grad is None or grad.layout != torch.strided:
                    continue
                in_old = bool(old.numel()) and grad.data_ptr() == old.data_ptr()
                was_solo = not old.numel() and self.as_bucket_view and grad.dtype == p.dtype
                if new.numel() and (in_old or was_solo):
                    new.copy_(grad)
                    p.grad = new
                elif in_old:  # now in a bucket of its own: the gradient becomes a tensor of its own
                    p.grad = grad.clone()

    @staticmethod
    def _make_hook(ref: "weakref.ref[GradientSynchronizer]", index: int) -> Any:
        @not_traced
        def hook(_param: torch.Tensor) -> None:
            sync = ref()
            if sync is not None:
                sync._on_grad(index)
        return hook

    def _reset(self) -> None:
        self._passes = [0] * len(self.params)
        self._waiting = [len(b.params) for b in self.plan.buckets]
        self._next = 0
        self._inflight: dict[int, tuple[Handle, Any, torch.Tensor]] = {}
        self._has_grad = [0.0] * len(self.params)
        self._ready: list[int] = []
        self._callback_queued = False

    def rebind(self, comm: Communicator) -> None:
        """Reduce over ``comm`` from now on, dropping any step in flight (an elastic job re-formed).

        Collective over ``comm``: the same model check the constructor makes, so that
        members of the old job and workers that just joined (and are constructing
        their optimizer) issue the same collectives. The buckets go back to the
        constructor's plan and are rebuilt after the next step, as on a new worker.
        """
        entries = [(n, tuple(p.shape), dtype_name(p)) for n, p in zip(self.names, self.params)]
        order = agree_parameters(comm, entries)
        if order != list(range(len(entries))):
            raise ModelMismatchError("after the reset, rank 0's parameters come in a different order")
        with self._lock:
            self.comm = comm
            if self._rebuild_enabled and not self._rebuild_pending:
                self._install_plan(None)
                self._rebuild_pending = True
            self._reset()

    def drop_step(self) -> None:
        """Forget the step in flight without any collective (its group lost a rank)."""
        with self._lock:
            self._reset()

    @property
    def started_buckets(self) -> int:
        """How many buckets of the current step have their allreduce in flight."""
        return len(self._inflight)

    @property
    def pending(self) -> bool:
        """True between the first gradient of a step and :meth:`synchronize`."""
        return any(self._passes) or bool(self._inflight)

    def _on_grad(self, i: int) -> None:
        with self._lock:
            if not self.enabled:
                return
            if self._passes[i] >= self.passes_per_step:
                raise ShardwiseError(
                    f"the gradient of '{self.names[i]}' was computed more than backward_passes_per_step="
                    f"{self.passes_per_step} times before step()/synchronize(); raise "
                    "backward_passes_per_step to accumulate gradients locally")
            self._passes[i] += 1
            if self.finalize_on_backward and not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self.synchronize)
                self._callback_queued = True
            if self._passes[i] == self.passes_per_step:
                self._ready.append(i)
                bucket = self._where[i][0]
                self._waiting[bucket] -= 1
                while self._next < len(self._buffers) and self._waiting[self._next] == 0:
                    self._launch(self._next)
                    self._next += 1

    def _in_bucket(self, i: int) -> bool:
        grad, view = self.params[i].grad, self._views[i]
        return (grad is not None and grad.layout == torch.strided and grad.data_ptr() == view.data_ptr()
                and grad.shape == view.shape)

    def _launch(self, b: int) -> None:
        if self._solo[b]:
            self._launch_solo(b)
            return
        bucket, buf = self.plan.buckets[b], self._buffers[b]
        with torch.no_grad():
            for i, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
                p = self.params[i]
                if p.grad is None:
                    buf[off:off + n].zero_()
                    continue
                self._has_grad[i] = 1.0
                if self._in_bucket(i):
                    continue
                grad = p.grad
                # sparse gradients travel dense (Horovod's sparse_as_dense)
                self._views[i].copy_(grad.to_dense() if grad.is_sparse else grad)
                if self.as_bucket_view and not grad.is_sparse and grad.dtype == p.dtype:
                    p.grad = self._views[i]  # frees the separate gradient tensor
            if self._piggyback and b == len(self._buffers) - 1:  # every bucket before it is launched
                buf[bucket.numel:].copy_(torch.tensor(self._has_grad, dtype=buf.dtype, device=buf.device))
            self._start(b, buf)

    def _launch_solo(self, b: int) -> None:
        """Reduce the gradient of a one-parameter bucket where it lies (a dense copy if it must travel dense)."""
        i = self.plan.buckets[b].params[0]
        p = self.params[i]
        grad = p.grad
        with torch.no_grad():
            if grad is None:
                target = torch.zeros_like(p, memory_format=torch.contiguous_format)
            else:
                self._has_grad[i] = 1.0
                if travels_as_is(grad, p):
                    target = grad
                else:
                    target = torch.empty_like(p, memory_format=torch.contiguous_format)
                    target.copy_(grad.to_dense() if grad.is_sparse else grad)
            self._start(b, target)

    def _start(self, b: int, target: torch.Tensor) -> None:
        scale = 1.0 / self.predivide
        if self.average_aggregated:
            scale /= self.passes_per_step
        if scale != 1.0:
            target.mul_(scale)
        wire, ctx = self.compression.compress(target)
        handle = self.comm.allreduce_async(wire, self.op, inplace=True, name=f"grad_bucket_{b}")
        self._inflight[b] = (handle, ctx, target)

    @not_traced  # also autograd's end-of-backward callback, inside a compiled step's backward
    def synchronize(self) -> None:
        """Issue the buckets still waiting, wait for all, and leave the reduced gradients in ``.grad``."""
        with self._lock:
            for b in range(self._next, len(self._buffers)):
                self._launch(b)
            self._next = len(self._buffers)
            present = None
            if not self._piggyback:
                self._present.copy_(torch.tensor(self._has_grad, dtype=torch.float32, device=self._present.device))
                present = self.comm.allreduce_async(self._present, ReduceOp.MAX, inplace=True,
                                                    name="grad_presence")
            with torch.no_grad():
                for b in range(len(self._buffers)):
                    handle, ctx, target = self._inflight[b]
                    out = self.compression.decompress(handle.wait(), ctx)
                    if out is not target:
                        target.copy_(out)
                    if self.predivide != 1.0:
                        target.mul_(self.predivide)
                if present is not None:
                    used = present.wait().tolist()
                elif self._buffers:
                    used = self._buffers[-1][self.plan.buckets[-1].numel:].tolist()
                else:
                    used = []
                for b, bucket in enumerate(self.plan.buckets):
                    if self._solo[b]:
                        self._settle_solo(bucket.params[0], self._inflight[b][2], used)
                        continue
                    for i in bucket.params:
                        p, view = self.params[i], self._views[i]
                        if self._in_bucket(i):
                            continue
                        if p.grad is not None and not p.grad.is_sparse:
                            p.grad.copy_(view)
                        elif p.grad is not None:  # a sparse gradient stays sparse, as in Horovod
                            p.grad = view.to_sparse()
                        elif used[i] > 0:
                            p.grad = view if self.as_bucket_view else view.clone()
            if self._rebuild_pending:
                self._rebuild(self._ready)
            self._reset()

    def _settle_solo(self, i: int, reduced: torch.Tensor, used: list[float]) -> None:
        """Leave the reduced gradient of a one-parameter bucket in ``.grad``."""
        p = self.params[i]
        if p.grad is reduced:
            return
        if p.grad is None:
            if used[i] > 0:
                p.grad = reduced
        elif p.grad.is_sparse:
            p.grad = reduced.to_sparse()
        else:
            p.grad.copy_(reduced)

    def _rebuild(self, ready: list[int]) -> None:
        """Re-plan the buckets in rank 0's gradient-ready order (collective, once)."""
        self._rebuild_pending = False
        order = self.comm.broadcast_object(ready if self.comm.rank == 0 else None, 0)
        seen = set(order)
        order = list(order) + [i for i in range(len(self.params) - 1, -1, -1) if i not in seen]
        if [p for b in self.plan.buckets for p in b.params] != order:
            self._install_plan(order)

    def remove(self) -> None:
        """Detach the hooks; the parameters are no longer synchronised."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    def describe(self) -> list[dict[str, Any]]:
        """The bucket layout: per bucket, its parameter names, element count and dtype."""
        return [{"params": [self.names[i] for i in b.params], "numel": b.numel, "dtype": b.dtype}
                for b in self.plan.buckets]

    def __repr__(self) -> str:
        return (f"GradientSynchronizer({len(self.params)} params, {len(self._buffers)} buckets, "
                f"cap={self.plan.cap_bytes} B, op={self.op.value}, comm={self.comm!r})")
