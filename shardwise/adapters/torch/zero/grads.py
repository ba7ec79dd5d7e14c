"""Gradient reduction of ZeRO during backward, one partition unit (bucket) at a time.

A post-accumulate-grad hook sees each gradient as autograd produces it.

* Stage 1 keeps each unit's gradients in one persistent flat buffer: a gradient that
  arrives as a tensor of its own (the first backward after ``zero_grad()``) is copied
  in while it is still in cache and ``.grad`` becomes a view of the buffer, so later
  passes accumulate straight into it. On the last backward of an accumulation window
  a complete unit's buffer is reduce-scattered in place, one unit in flight at a
  time: each rank's own range of the buffer receives the averaged shard it steps,
  the ZeRO paper's stage 1 (half the bytes of an allreduce; with the gather of the
  updated parameters, the same traffic as plain data parallelism). After it, the
  parameters' ``.grad`` hold the averaged gradient in the range this rank owns and its
  own, unreduced gradient elsewhere.
* Stages 2 and 3 move each gradient into its slot of the unit's flat buffer as soon
  as it arrives and free the parameter's ``.grad`` at once; a complete unit is
  reduce-scattered asynchronously and its flat buffer is released when that
  reduce-scatter is waited for, which happens as the next unit's first gradient
  arrives (like FSDP2's ``reduce_scatter_max_input_buffers=1``). So at most one
  full unit is in flight while the next one fills: full gradients stay within about
  two units however many units the model has, and each reduce-scatter overlaps the
  backward computation of the following unit.

At stages 2 and 3 a linear layer's weight gradient can also be written straight into
its slot of the flat buffer by the GEMM that computes it (:mod:`.fusion`), with no
``.grad`` in between. Such a contribution is announced in forward (:meth:`GradReducer.expect`),
so a parameter whose gradient comes in several parts (a weight used twice, or through a
fused GEMM and another op) counts as complete only once every part has arrived. A
share nobody announced (a retained graph run a second time) leaves its unit to the
end-of-backward sweep, as does a share that never comes.

With hybrid sharding (a unit's ``replicate`` group, as FSDP2's HSDP and DeepSpeed's MiCS) the
reduce-scatter runs within the unit's shard group and the reduced shard is then averaged over the
replicas holding the same shard in the other groups, while the next unit's reduce-scatter runs.

At the end of backward, units that got no (or only part of their) gradient this
step are reduced in a fixed order, so every rank issues the same collectives, and
every reduction is waited for.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from shardwise.core.comm import Handle
from shardwise.core.errors import ShardwiseError

from ..compiling import not_traced
from .units import ZeroUnit


class GradReducer:
    """Drives the per-unit reductions of one :class:`~.optimizer.ZeroOptimizer`."""

    def __init__(self, units: list[ZeroUnit], stage: int, accumulation_steps: int,
                 before_reduce: Callable[[ZeroUnit], None] = lambda unit: None,
                 after_reduce: Callable[[ZeroUnit], None] = lambda unit: None) -> None:
        self.units, self.stage, self.accumulation_steps = units, stage, accumulation_steps
        self.before_reduce, self.after_reduce = before_reduce, after_reduce
        self.backward_passes = 0  # completed since the last optimizer step
        self.in_backward = False
        self.ready: dict[int, set[int]] = {}  # unit index -> positions whose gradient is complete
        self.written: dict[int, set[int]] = {}  # stages 2/3: positions with data in the unit's flat buffer
        # Contributions announced in forward and not yet arrived: fused GEMMs per (unit, position),
        # and the parameters whose ``.grad`` (post-accumulate hook) is also due.
        self.fused_due: dict[tuple[int, int], int] = {}
        self.hook_due: set[tuple[int, int]] = set()
        self.fused_keys: set[tuple[int, int]] = set()  # parameters with a fused share this pass
        self.uncounted: set[int] = set()  # units that got a fused share nobody announced (left to the sweep)
        self.passes = 0  # backward passes cleared so far (never reset; dates the announcements above)
        self.started: dict[int, Optional[Handle]] = {}  # units whose reduction started this pass
        self.filling: dict[int, torch.Tensor] = {}  # stages 2/3: flat buffers being filled
        self.in_flight: Optional[tuple[ZeroUnit, Handle]] = None  # the one reduce-scatter in flight
        #: Hybrid sharding: the reduced shard of the last retired unit, being averaged over the unit's
        #: replicas (``unit.replicate``) while the next unit's reduce-scatter runs; with the tensor to
        #: add to the master gradient after it (None: the all-reduce runs in the master gradient).
        self.across: Optional[tuple[ZeroUnit, Optional[torch.Tensor], Handle]] = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(unit, i))
                         for unit in units for i, p in enumerate(unit.params)]

    def remove(self) -> None:
        """Take the gradient hooks off (idempotent): later backward passes reduce nothing.

        A reduce-scatter still in flight is waited for first, so no collective is left pending.
        """
        self._drain()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def boundary(self) -> bool:
        """True when the backward in progress ends an accumulation window."""
        return (self.backward_passes + 1) % self.accumulation_steps == 0

    def _reduces_now(self) -> bool:
        return self.stage > 1 or self.boundary

    def _hook(self, unit: ZeroUnit, position: int) -> Callable[[torch.Tensor], None]:
        # Weak references: the parameter keeps its hooks on the C++ side, where the garbage
        # collector cannot see a cycle through them, so a strong one to the reducer or the unit
        # (whose engine may hold the model) would keep the model alive after the user dropped it.
        me, unit_ref = weakref.ref(self), weakref.ref(unit)

        @not_traced
        def hook(param: torch.Tensor) -> None:
            self, unit = me(), unit_ref()
            if self is None or unit is None:
                return
            self._enter_backward()
            if param.grad is None and (unit.index, position) in self.fused_keys:
                return  # autograd's node ran with nothing to add: every share went through a fused GEMM
            if self.stage > 1:
                written = self.written.setdefault(unit.index, set())
                self._take(unit, position, again=position in written)
                written.add(position)
            else:
                unit.keep_grad(position)
            self._arrived(unit, position, fused=False)
        return hook

    def _enter_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def expect(self, unit: ZeroUnit, position: int, fused: bool) -> None:
        """Forward: a gradient contribution is due for this parameter, from a fused GEMM or from its ``.grad``."""
        key = (unit.index, position)
        if fused:
            self.fused_due[key] = self.fused_due.get(key, 0) + 1
            self.fused_keys.add(key)
        else:
            self.hook_due.add(key)

    def withdraw_fused(self, unit: ZeroUnit, position: int, passes: int, unused: list) -> None:
        """A fused share announced while ``passes`` backward passes were complete will not come: its graph is gone."""
        key = (unit.index, position)
        if unused[0] and passes == self.passes and key in self.fused_due:
            left = self.fused_due.pop(key) - 1
            if left > 0:
                self.fused_due[key] = left

    def _arrived(self, unit: ZeroUnit, position: int, fused: bool) -> None:
        """One contribution arrived; start the unit's reduction once every parameter is complete."""
        key = (unit.index, position)
        if fused and key not in self.fused_keys:
            # Not announced since the last pass: a retained graph run again. Its shares cannot be
            # counted, so the unit is reduced by the end-of-backward sweep.
            self.uncounted.add(unit.index)
            return
        if fused:
            left = self.fused_due.get(key, 1) - 1
            if left > 0:
                self.fused_due[key] = left
                return
            self.fused_due.pop(key, None)
            if key in self.hook_due:
                return  # the share that reaches ``.grad`` is still to come
        else:
            self.hook_due.discard(key)
            if self.fused_due.get(key, 0) > 0:
                return
        seen = self.ready.setdefault(unit.index, set())
        seen.add(position)
        if len(seen) == len(unit.params) and self._reduces_now() and unit.index not in self.uncounted:
            self._start(unit)

    def fused_grad_slot(self, unit: ZeroUnit, position: int) -> tuple[torch.Tensor, bool]:
        """Stages 2/3: parameter ``position``'s slot in the unit's flat buffer, and whether it already holds data."""
        self._enter_backward()
        slot = unit.plan.params[position]
        flat = self._buffer(unit, unit.names[position])
        written = self.written.setdefault(unit.index, set())
        again = position in written
        written.add(position)
        return flat[slot.offset: slot.offset + slot.numel].view(slot.shape), again

    def fused_grad_written(self, unit: ZeroUnit, position: int) -> None:
        """A fused GEMM finished writing its share of parameter ``position``'s gradient."""
        self._arrived(unit, position, fused=True)

    # -- stages 2 and 3 -----------------------------------------------------------------------------
    def _take(self, unit: ZeroUnit, position: int, again: bool) -> None:
        """Move one parameter's fresh ``.grad`` into the unit's flat buffer and free it.

        A unit of one parameter whose gradient arrives whole, in the buffer's exact size, dtype
        and device (an embedding table over a dp size that divides it), takes that gradient as its
        buffer instead: no second copy of the unit's largest transient (for GPT-2's 50257 x 768
        table, 147 MiB).
        """
        grad = unit.params[position].grad
        if (not again and len(unit.params) == 1 and unit.index not in self.filling
                and unit.index not in self.started and grad is not None and grad.is_contiguous()
                and grad.numel() == unit.plan.padded_numel and grad.dtype == unit.dtype
                and grad.device == unit.device and not grad.requires_grad):
            self._retire()
            self.filling[unit.index] = grad.view(-1)
            unit.params[position].grad = None
            return
        unit.take_grad(position, self._buffer(unit, unit.names[position]), add=again)

    def grad_buffer(self, unit: ZeroUnit) -> torch.Tensor:
        """Stages 2/3: ``unit``'s flat gradient of this pass (zeros if none arrived), before its reduction starts."""
        return self._buffer(unit, unit.names[0])

    def _buffer(self, unit: ZeroUnit, name: str) -> torch.Tensor:
        """The unit's flat gradient buffer of this pass, allocated when first needed (after retiring the last one)."""
        if unit.index in self.started:
            raise ShardwiseError(
                f"ZeRO: parameter {name!r} got a gradient after its unit was reduce-scattered "
                "in this backward pass (reentrant activation checkpointing is not supported at stages 2/3)")
        flat = self.filling.get(unit.index)
        if flat is None:
            self._retire()  # free the previous unit's buffer before this one is allocated
            flat = self.filling[unit.index] = unit.new_grad_buffer()
        return flat

    def _retire(self) -> None:
        """Wait for the reduce-scatter in flight and hand its shard to the master gradient.

        With hybrid sharding the shard is first averaged over the unit's replicas: that
        all-reduce is started here and completed at the next retirement (or the end of backward).
        """
        self._finish_across()
        if self.in_flight is not None:
            unit, handle = self.in_flight
            self.in_flight = None
            shard = handle.wait()  # stage 1: this rank's block of the unit's buffer; 2, 3: a new shard
            del handle  # stages 2, 3: the unit's flat buffer goes with it, before the shard is used
            if unit.replicate is None:
                self._to_master(unit, shard)
            elif self.stage == 1:
                self.across = (unit, None, unit.replicate.allreduce_async(shard, "average", inplace=True))
            else:  # into the master gradient when it has none yet, so the all-reduce runs there
                target, in_master = unit.reduced_grad_target(shard)
                self.across = (unit, None if in_master else target,
                               unit.replicate.allreduce_async(target, "average", inplace=True))

    def _finish_across(self) -> None:
        if self.across is not None:
            unit, pending, handle = self.across
            self.across = None
            reduced = handle.wait()
            if self.stage == 1:
                unit.set_master_grad(reduced)
            elif pending is not None:
                unit.accumulate_master_grad(reduced)

    def _to_master(self, unit: ZeroUnit, shard: torch.Tensor) -> None:
        if self.stage == 1:
            unit.set_master_grad(shard)  # already in its place in the unit's buffer
        else:
            unit.accumulate_master_grad(shard)

    def _drain(self) -> None:
        """Complete every reduction in flight."""
        self._retire()
        self._finish_across()

    def _start(self, unit: ZeroUnit) -> None:
        if unit.index in self.started:
            return
        self.before_reduce(unit)
        if self.stage == 1:
            self._retire()  # one unit's reduce-scatter buffers at a time
            self.started[unit.index] = None
            flat = unit.flat_grads(keep=True)
            self.in_flight = (unit, unit.comm.reduce_scatter_in_place_async(flat, "average"))
        else:
            flat = self.filling.pop(unit.index, None)
            self._retire()
            if flat is None:  # no gradient this step: reduce zeros, as every rank does here
                flat = unit.new_grad_buffer()
            unit.drop_full_grads()
            self.started[unit.index] = None
            self.in_flight = (unit, unit.comm.reduce_scatter_async(flat, "average"))
            del flat  # the handle keeps the buffer alive only until it is waited for
        self.after_reduce(unit)

    @not_traced
    def _end_of_backward(self) -> None:
        if self._reduces_now():
            for unit in self.units:  # unused (or partly used) this step: same order on every rank
                self._start(unit)
            self._drain()
        self._clear()
        self.backward_passes += 1

    def _clear(self) -> None:
        self.passes += 1  # expectations announced before this point belong to a finished pass
        self.started.clear()
        self.ready.clear()
        self.written.clear()
        self.fused_due.clear()
        self.hook_due.clear()
        self.fused_keys.clear()
        self.uncounted.clear()
        self.filling.clear()
        self.in_backward = False

    def discard(self) -> None:
        """Forget the backward passes since the last step and any reduction they left behind."""
        self.in_flight = self.across = None
        self._clear()
        self.reset()

    def window_complete(self) -> bool:
        """True when the passes since the last step fill a whole accumulation window."""
        return self.backward_passes % self.accumulation_steps == 0 and self.backward_passes > 0

    def reset(self) -> None:
        self.backward_passes = 0
