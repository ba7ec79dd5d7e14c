"""Gradient reduction of ZeRO during backward, one partition unit (bucket) at a time.

A post-accumulate-grad hook counts each unit's ready gradients; when a unit is
complete its reduction starts asynchronously — an allreduce into the persistent
flat gradient buffer (stage 1, only on the last backward of an accumulation
window) or a reduce-scatter into the owned shard (stages 2 and 3, every backward,
after which the full gradients are freed). At the end of backward, units that got
no gradient (unused this step) are reduced with zeros in a fixed order, so every
rank issues the same collectives, and all reductions are waited for.
"""

from __future__ import annotations

from typing import Callable

import torch

from .zero_units import ZeroUnit


class GradReducer:
    """Drives the per-unit reductions of one :class:`~.zero.ZeroOptimizer`."""

    def __init__(self, units: list[ZeroUnit], stage: int, accumulation_steps: int,
                 before_reduce: Callable[[ZeroUnit], None] = lambda unit: None,
                 after_reduce: Callable[[ZeroUnit], None] = lambda unit: None) -> None:
        self.units, self.stage, self.accumulation_steps = units, stage, accumulation_steps
        self.before_reduce, self.after_reduce = before_reduce, after_reduce
        self.backward_passes = 0  # completed since the last optimizer step
        self.in_backward = False
        self.ready: dict[int, int] = {}
        self.started: dict[int, object] = {}
        for unit in units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(self._hook(unit))

    @property
    def boundary(self) -> bool:
        """True when the backward in progress ends an accumulation window."""
        return (self.backward_passes + 1) % self.accumulation_steps == 0

    def _reduces_now(self) -> bool:
        return self.stage > 1 or self.boundary

    def _hook(self, unit: ZeroUnit) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self.in_backward:
                self.in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.ready[unit.index] = self.ready.get(unit.index, 0) + 1
            if self.ready[unit.index] == len(unit.params) and self._reduces_now():
                self._start(unit)
        return hook

    def _start(self, unit: ZeroUnit) -> None:
        if unit.index in self.started:
            return
        self.before_reduce(unit)
        if self.stage == 1:
            flat = unit.flat_grads(keep=True)
            handle = unit.comm.allreduce_async(flat, "average", inplace=True)
        else:
            handle = unit.comm.reduce_scatter_async(unit.flat_grads(), "average")
            unit.drop_full_grads()
        self.started[unit.index] = handle
        self.after_reduce(unit)

    def _end_of_backward(self) -> None:
        if self._reduces_now():
            for unit in self.units:  # unused this step: zero gradients, same order on every rank
                self._start(unit)
            for unit in self.units:
                result = self.started[unit.index].wait()
                if self.stage == 1:
                    unit.master_grad_from_flat()
                else:
                    unit.accumulate_master_grad(result)
        self.started.clear()
        self.ready.clear()
        self.in_backward = False
        self.backward_passes += 1

    def window_complete(self) -> bool:
        """True when the passes since the last step fill a whole accumulation window."""
        return self.backward_passes % self.accumulation_steps == 0 and self.backward_passes > 0

    def reset(self) -> None:
        self.backward_passes = 0
