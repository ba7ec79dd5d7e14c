"""ZeRO's optimizer step: update this rank's shards and gather the new parameters to every rank.

With a per-parameter torch optimizer (:data:`PER_PARAMETER_OPTIMIZERS`), one parameter
group and no step hooks, the units are stepped one at a time, so each unit's
allgather runs while the next unit's update computes; otherwise the whole optimizer
steps first. Either way the next unit's allgather is in flight while this one's lands
(two gathered units at most).

With ``overlap_publish`` (:class:`DeferredPublish`) the step does not wait for the gathers
at all: the units are stepped in forward order and each module's forward pre-hook waits for
the gather of its own parameters, so the gathers of later layers run while the first ones
compute, as FSDP's unsharding in forward does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.optim.optimizer as optim_hooks
from torch import nn

from ..compiling import not_traced
from .units import ZeroUnit

__all__ = ["PER_PARAMETER_OPTIMIZERS", "DeferredPublish", "step_and_publish", "steps_per_unit"]

#: torch.optim classes whose update of a parameter reads only that parameter's gradient and
#: state: stepping ZeRO's units one after the other is then exactly one step of all of them.
PER_PARAMETER_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop",
                                      "Rprop", "ASGD", "Adadelta", "Adafactor"})


def steps_per_unit(inner: torch.optim.Optimizer, units: Sequence[ZeroUnit]) -> bool:
    """True when stepping ``units`` one at a time is the same update as one step of all of them."""
    cls = type(inner)
    return (len(units) > 1 and cls.__module__.startswith("torch.optim")
            and cls.__name__ in PER_PARAMETER_OPTIMIZERS and len(inner.param_groups) == 1
            and not inner._optimizer_step_pre_hooks and not inner._optimizer_step_post_hooks
            and not optim_hooks._global_optimizer_pre_hooks and not optim_hooks._global_optimizer_post_hooks)


def step_and_publish(inner: torch.optim.Optimizer, units: Sequence[ZeroUnit], *, defer: bool = False) -> None:
    """Step ``inner`` over the units' master shards and publish each unit's new parameters.

    With ``defer`` the gathers are left in flight (``unit.publishing``) for
    :class:`DeferredPublish` to wait on.
    """
    group = inner.param_groups[0] if steps_per_unit(inner, units) else None
    if group is None:
        inner.step()
    every = group["params"] if group is not None else None
    in_flight: list = []
    try:
        for unit in units:
            if group is not None:
                group["params"] = [unit.master]
                inner.step()
            if defer:
                unit.publishing = unit.start_publish()
                continue
            in_flight.append((unit, unit.start_publish()))
            if len(in_flight) == 2:
                done, handle = in_flight.pop(0)
                done.finish_publish(handle)
    finally:
        if group is not None:
            group["params"] = every
    for unit, handle in in_flight:
        unit.finish_publish(handle)


class DeferredPublish:
    """Waits for each unit's parameter gather where its parameters are next needed.

    A forward pre-hook on every module that owns parameters of a unit waits for that
    unit's gather; so do :meth:`wait_all` (called by the optimizer before anything else
    reads or writes parameters: the next step, checkpoints, resharding) and the module's
    ``state_dict`` / ``load_state_dict``. Parameters read outside those (another module
    reading a foreign weight before its owner's forward, an EMA copy right after the
    step) must call :meth:`wait_all` first.
    """

    def __init__(self, module: nn.Module, units: Sequence[ZeroUnit]) -> None:
        self.units = list(units)
        unit_of = {id(p): unit for unit in self.units for p in unit.params}
        #: The units in the order forward first uses them: the order to step and gather in.
        self.forward_order: list[ZeroUnit] = []
        for sub in module.modules():
            mine = {id(unit_of[id(p)]): unit_of[id(p)] for p in sub.parameters(recurse=False) if id(p) in unit_of}
            if not mine:
                continue
            self.forward_order.extend(u for u in mine.values() if u not in self.forward_order)
            sub.register_forward_pre_hook(self._waiter(list(mine.values())))
        self.forward_order.extend(u for u in self.units if u not in self.forward_order)

    @staticmethod
    def _waiter(units: list[ZeroUnit]) -> Any:
        @not_traced
        def wait(_module: nn.Module, _args: Any) -> None:
            for unit in units:
                if unit.publishing is not None:
                    unit.await_publish()
        return wait

    def wait_all(self) -> None:
        """Block until every unit's parameters are complete."""
        for unit in self.units:
            unit.await_publish()
