"""Module hooks of ZeRO stage 3: gather parameters just in time, free them after use.

Forward: a unit's parameters are all-gathered before its module runs (the next
unit's gather is started ahead, in the order recorded on the first step) and freed
when it returns. Backward: a hook on the module's outputs gathers them again
before the module's gradients are computed, and starts the gather of the unit whose
backward comes next — the one that returned before it in this step's forward, as
FSDP2 prefetches in reverse post-forward order — so that gather overlaps this unit's
backward. :class:`~.grads.GradReducer` frees a unit once its gradients are
reduce-scattered; gathers started ahead but never used are completed and dropped at
the end of backward, before the optimizer step can change the shards.

With ``reshard_after_forward=False`` (FSDP2's option of that name, DeepSpeed's reuse
distance) a unit whose outputs need gradients stays gathered from its forward to its
backward: one allgather per unit and step instead of two, for the full parameters of
every such unit held through the forward. The root unit (the parameters of the model itself,
outside every wrapped module) is always kept so, as FSDP2 keeps its root: its forward is the last
and its backward the first. A unit kept but never reached by a backward is freed when the
optimizer step (or a load) changes its shard.

Every decision depends only on the forward pass just run and on which hooks fired,
so every rank starts the same allgathers in the same order: nothing is prefetched
that a rank might skip. Ranks whose modules run in different orders are caught before
each gather (:mod:`.agreement`): :class:`~shardwise.core.errors.DivergenceError` on
every rank.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..compiling import never_traced, not_traced
from .agreement import GatherCheck
from .units import ZeroUnit


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _in_backward() -> bool:
    """True while autograd runs a backward pass (a forward now is a checkpointed recomputation)."""
    return torch._C._current_graph_task_id() != -1


class Stage3Hooks:
    """Installs the gather/free hooks of every unit on its module (the root for the root unit)."""

    def __init__(self, root: nn.Module, units: list[ZeroUnit], prefetch: bool = True,
                 reshard_after_forward: bool = True) -> None:
        self.units, self.prefetch, self.reshard_after_forward = units, prefetch, reshard_after_forward
        self.order: list[int] = []  # forward order of the units, recorded on the first pass
        self.recorded = False
        # Units in the order their forward returned (with outputs needing gradients), this step.
        self.post_order: list[int] = []
        self.draining = False  # an end-of-backward clean-up is queued
        # One check per communicator the units gather over (dp; expert units over their edp group).
        by_comm: dict[int, list[ZeroUnit]] = {}
        for unit in units:
            by_comm.setdefault(id(unit.comm), []).append(unit)
        self.checks = [GatherCheck(group[0].comm, group) for group in by_comm.values()]
        for check in self.checks:
            for unit in check.units.values():
                unit.check = check
        self._handles = [root.register_forward_pre_hook(self._root_pre_forward)]
        for unit in units:
            module = unit.module if unit.module is not None else root
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(unit)))
            self._handles.append(module.register_forward_hook(self._post_forward(unit)))

    def remove(self) -> None:
        """Take the module hooks off (idempotent); the units stay as they are (gathered or not)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @not_traced
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self.recorded = self.recorded or bool(self.order)
        self.post_order = []
        if not _in_backward():
            for check in self.checks:
                check.new_pass()

    def _pre_forward(self, unit: ZeroUnit) -> Callable:
        @never_traced
        def hook(module: nn.Module, args: Any) -> None:
            if unit.module is not None and not self.recorded and not _in_backward():
                self.order.append(unit.index)
            unit.gather()
            if self.prefetch and self.recorded and unit.index in self.order and not _in_backward():
                pos = self.order.index(unit.index)
                if pos + 1 < len(self.order):
                    self.units[self.order[pos + 1]].prefetch()
        return hook

    def _post_forward(self, unit: ZeroUnit) -> Callable:
        @never_traced
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outs = [t for t in _tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
            if outs:
                order, position = self.post_order, len(self.post_order)  # this forward's list
                order.append(unit.index)
                fired = [False]

                @not_traced
                def regather(grad: torch.Tensor) -> None:
                    if not fired[0]:
                        fired[0] = True
                        self._backward_gather(unit, order[:position])

                for t in outs:
                    t.register_hook(regather)
            # The root unit's forward ends the model's, and its backward comes first: kept
            # gathered for it, as FSDP2 keeps its root (one gather fewer per step).
            keep = bool(outs) and (not self.reshard_after_forward or unit.module is None)
            if not _in_backward() and not keep:
                # Not a forward recomputed in backward (activation checkpointing), whose
                # module's backward, next, still needs the parameters: the reducer frees them.
                unit.release()
        return hook

    def _backward_gather(self, unit: ZeroUnit, before: list[int]) -> None:
        """Gather ``unit`` for its backward; start gathering the last unit in ``before`` (the next backward)."""
        if not self.draining:
            self.draining = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        unit.gather()
        if not self.prefetch:
            return
        for earlier in reversed(before):
            if earlier != unit.index:
                self.units[earlier].prefetch()  # no-op when already gathered or in flight
                return

    @not_traced
    def _end_of_backward(self) -> None:
        self.draining = False
        for unit in self.units:  # same order on every rank
            unit.discard_prefetch()
