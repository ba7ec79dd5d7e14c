"""ZeRO's optimizer step: update this rank's shards and gather the new parameters to every rank.

With a per-parameter torch optimizer (:data:`PER_PARAMETER_OPTIMIZERS`), one parameter
group and no step hooks, the units are stepped one at a time, so each unit's
allgather runs while the next unit's update computes; otherwise the whole optimizer
steps first. Either way the next unit's allgather is in flight while this one's lands
(two gathered units at most).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.optim.optimizer as optim_hooks

from .zero_units import ZeroUnit

__all__ = ["PER_PARAMETER_OPTIMIZERS", "step_and_publish", "steps_per_unit"]

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


def step_and_publish(inner: torch.optim.Optimizer, units: Sequence[ZeroUnit]) -> None:
    """Step ``inner`` over the units' master shards and publish each unit's new parameters."""
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
            in_flight.append((unit, unit.start_publish()))
            if len(in_flight) == 2:
                done, handle = in_flight.pop(0)
                done.finish_publish(handle)
    finally:
        if group is not None:
            group["params"] = every
    for unit, handle in in_flight:
        unit.finish_publish(handle)
