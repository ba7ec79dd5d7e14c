"""Keras on torch: start each gradient bucket's allreduce during backward, as torch DDP does.

Keras's torch trainer runs ``loss.backward()`` and only then hands the gradients to
the optimizer; averaging them there leaves the network idle during backward and
the CPU idle during the allreduce. Here a post-accumulate-grad hook on every
parameter marks it ready; when every parameter of a bucket is ready, its gradients
are copied into the bucket's buffer (kept from step to step, and for an average
scaled by 1/size in the same pass, as DDP does) and its allreduce starts
asynchronously, in place. A parameter of at least
:data:`~shardwise.core.buckets.DEFAULT_SOLO_BYTES` is a bucket of its own whose
gradient is reduced where it lies (scaled in place for an average), with no buffer
and no copy. Buckets are
planned from the last layer back (the order autograd produces gradients) and are
launched strictly in bucket order, so every rank issues the same collectives in
the same order. :meth:`BackwardOverlap.take` then waits for them and returns the
averaged gradients, or ``None`` when the gradients it is given are not the ones
the hooks saw (a wrapper changed them), after waiting for what was in flight. A
second backward pass before ``take`` turns the overlap off for good, on every rank
alike: gradients accumulated over passes, or an optimizer the model no longer uses.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ...core.buckets import DEFAULT_SOLO_BYTES, plan_buckets
from ...core.comm import Communicator, Handle, ReduceOp
from ..torch.compiling import not_traced
from ..torch.grad_sync import travels_as_is
from ..horovod.compression import dtype_name
from .ops import itemsize

__all__ = ["BackwardOverlap", "FIRST_BUCKET_BYTES"]

#: The first bucket (the last layer's gradients) is kept small so that communication starts
#: early, as DDP does with its 1 MiB first bucket.
FIRST_BUCKET_BYTES = 1024 * 1024


class BackwardOverlap:
    """Hooks on ``variables``' torch parameters that reduce gradient buckets while backward runs."""

    def __init__(self, variables: Sequence[Any], comm: Communicator, op: ReduceOp, cap_bytes: int) -> None:
        self.params = [v.value for v in variables]
        self.comm, self.op = comm, op
        order = list(range(len(self.params)))[::-1]  # autograd finishes the last layers first
        first, total = 0, 0
        while first < len(order) and (first == 0 or total + self._bytes(order[first]) <= FIRST_BUCKET_BYTES):
            total += self._bytes(order[first])
            first += 1
        self.buckets = self._plan(order[:first], cap_bytes) + self._plan(order[first:], cap_bytes)
        self.bucket_of = {i: k for k, members in enumerate(self.buckets) for i in members}
        self.ready = [0] * len(self.buckets)
        self.flats: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self.launched: list[tuple[torch.Tensor, Handle]] = []
        self.active = True
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.index = {id(p): i for i, p in enumerate(self.params)}

    def _bytes(self, i: int) -> int:
        return self.params[i].numel() * self.params[i].element_size()

    def _plan(self, order: list[int], cap_bytes: int) -> list[list[int]]:
        """Buckets of ``order`` (parameter indices) under ``cap_bytes`` each."""
        if not order:
            return []
        dtypes = [dtype_name(self.params[i]) for i in order]
        plan = plan_buckets([self.params[i].numel() for i in order], dtypes, [itemsize(d) for d in dtypes],
                            cap_bytes, reverse=False, solo_bytes=DEFAULT_SOLO_BYTES)
        return [[order[p] for p in b.params] for b in plan.buckets]

    @not_traced
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.active:
            return
        k = self.bucket_of[self.index[id(param)]]
        if self.ready[k] == len(self.buckets[k]):
            # A second backward before take(): gradients accumulated over passes, or this optimizer is no
            # longer the model's. Stop overlapping for good (every rank sees the same), so a replaced
            # optimizer's hooks stop issuing collectives; take() then leaves the work to the plain path.
            self._drain()
            self.active = False
            return
        self.ready[k] += 1
        while len(self.launched) < len(self.buckets) and \
                self.ready[len(self.launched)] == len(self.buckets[len(self.launched)]):
            self._launch(len(self.launched))

    def _launch(self, k: int) -> None:
        members = self.buckets[k]
        if len(members) == 1 and self._launch_in_place(members[0]):
            return
        flat = self.flats[k]
        if flat is None:  # allocated once: a fresh 25 MiB buffer per step costs its page faults every step
            first = self.params[members[0]]
            flat = self.flats[k] = torch.empty(sum(self.params[i].numel() for i in members),
                                               dtype=first.dtype, device=first.device)
        op = self.op
        scale = None
        if op is ReduceOp.AVERAGE and flat.is_floating_point():
            op, scale = ReduceOp.SUM, 1.0 / self.comm.size  # divided on the way in, not in another pass
        offset = 0
        for i in members:
            n, grad = self.params[i].numel(), self.params[i].grad
            view = flat[offset:offset + n]
            if grad is None:
                view.zero_()
            elif scale is None:
                view.copy_(grad.reshape(-1))
            else:
                torch.mul(grad.reshape(-1), scale, out=view)
            offset += n
        self.launched.append((flat, self.comm.allreduce_async(flat, op, inplace=True)))

    def _launch_in_place(self, i: int) -> bool:
        """Reduce a lone parameter's gradient in its own tensor; False when it cannot travel as it is."""
        param, grad = self.params[i], self.params[i].grad
        if grad is None or not travels_as_is(grad, param) or self._bytes(i) < DEFAULT_SOLO_BYTES:
            return False
        op = self.op
        if op is ReduceOp.AVERAGE and grad.is_floating_point():
            op = ReduceOp.SUM
            grad.mul_(1.0 / self.comm.size)
        self.launched.append((grad, self.comm.allreduce_async(grad, op, inplace=True)))
        return True

    def _drain(self) -> None:
        for _, handle in self.launched:
            handle.wait()
        self.launched, self.ready = [], [0] * len(self.buckets)

    @not_traced  # jit_compile=True traces the optimizer step: the waits and unpacking run eagerly
    def take(self, grads: Sequence[Any]) -> Optional[list[Any]]:
        """The averaged ``grads`` (in order), or ``None`` if they are not the gradients the hooks saw."""
        mine = len(grads) == len(self.params) and all(
            g is p.grad and g is not None for g, p in zip(grads, self.params))
        if not mine or not self.launched or not self.active:
            self._drain()
            return None
        while len(self.launched) < len(self.buckets):  # buckets whose hooks did not all fire
            self._launch(len(self.launched))
        out: list[Any] = [None] * len(self.params)
        for (flat, handle), members in zip(self.launched, self.buckets):
            reduced = handle.wait()
            offset = 0
            for i in members:
                n = self.params[i].numel()
                out[i] = reduced[offset:offset + n].view_as(self.params[i])
                offset += n
        self.launched, self.ready = [], [0] * len(self.buckets)
        return out

    def abandon(self) -> None:
        """Take the hooks off and forget what is in flight, without waiting (its group lost a rank)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.launched, self.active = [], [], False

    def remove(self) -> None:
        """Take the hooks off and wait for anything in flight."""
        self._drain()
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
