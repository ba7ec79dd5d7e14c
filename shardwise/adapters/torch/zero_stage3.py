"""Module hooks of ZeRO stage 3: gather parameters just in time, free them after use.

Forward: a unit's parameters are all-gathered before its module runs (the next
unit's gather is started ahead, in the order recorded on the first step) and freed
when it returns. Backward: a hook on the module's outputs gathers them again
before the module's gradients are computed; once every parameter of the unit has
its gradient, the gradients are reduce-scattered into the owned shard and both
full parameters and full gradients are freed. Units that received no gradient
(unused this step) are reduced with zeros at the end of backward, so every rank
issues the same collectives in the same order.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .zero_units import ZeroUnit


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


class Stage3Hooks:
    """Installs and runs the gather/free/reduce hooks of every unit."""

    def __init__(self, root: nn.Module, units: list[ZeroUnit], reduce: Callable[[ZeroUnit], None],
                 prefetch: bool = True) -> None:
        self.root, self.units, self.reduce, self.prefetch = root, units, reduce, prefetch
        self.order: list[int] = []  # forward order of units, recorded on the first step
        self.recorded = False
        self.ready: dict[int, int] = {}  # unit index -> parameters whose gradient arrived
        self.reduced: set[int] = set()
        self.callback_queued = False
        root.register_forward_pre_hook(self._root_pre_forward)
        for unit in units:
            module = unit.module if unit.module is not None else root
            module.register_forward_pre_hook(self._pre_forward(unit))
            module.register_forward_hook(self._post_forward(unit))
            for p in unit.params:
                p.register_post_accumulate_grad_hook(self._grad_ready(unit))

    # -- forward ---------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        # A second forward pass: the first one has recorded the order of the units.
        self.recorded = self.recorded or bool(self.order)

    def _pre_forward(self, unit: ZeroUnit) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            if unit.module is not None and not self.recorded:
                self.order.append(unit.index)
            unit.gather()
            if self.prefetch and self.recorded and unit.module is not None:
                pos = self.order.index(unit.index) if unit.index in self.order else -1
                if 0 <= pos < len(self.order) - 1:
                    self.units[self.order[pos + 1]].prefetch()
        return hook

    def _post_forward(self, unit: ZeroUnit) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if torch.is_grad_enabled():
                outs = [t for t in _tensors(output) if t.requires_grad]
                if outs:
                    fired = [False]

                    def regather(grad: torch.Tensor) -> None:
                        if not fired[0]:
                            fired[0] = True
                            unit.gather()

                    for t in outs:
                        t.register_hook(regather)
            unit.release()
            return None
        return hook

    # -- backward ------------------------------------------------------------------------------------
    def _grad_ready(self, unit: ZeroUnit) -> Callable:
        def hook(param: torch.Tensor) -> None:
            if not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.ready[unit.index] = self.ready.get(unit.index, 0) + 1
            if self.ready[unit.index] == len(unit.params) and unit.index not in self.reduced:
                self._reduce(unit)
        return hook

    def _reduce(self, unit: ZeroUnit) -> None:
        self.reduced.add(unit.index)
        self.reduce(unit)
        unit.release()

    def _end_of_backward(self) -> None:
        for unit in self.units:  # unused units: zero-filled, in a fixed order on every rank
            if unit.index not in self.reduced:
                unit.gather()
                self._reduce(unit)
        self.ready.clear()
        self.reduced.clear()
        self.callback_queued = False

    def finish_pending(self) -> None:
        """Called by ``step()``: nothing is left in flight once backward has returned."""
        if self.callback_queued:
            self._end_of_backward()
