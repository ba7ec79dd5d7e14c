"""Which optimizer variable is which: the per-variable slots and the scalars of a Keras 3 optimizer.

Keras names a slot after the variable it shadows: ``add_variable_from_reference(v,
"momentum")`` makes ``"{v.path with '/' as '_'}_momentum"``, for every built-in
optimizer and for custom ones built the same way. So the slots of an optimizer
built over ``references`` are found by name, whatever the optimizer class and its
variable order, and a checkpoint can store "Adam's velocity of variable k"
whether Adam was built over the model's variables or over ZeRO's flat shards.
"""

from __future__ import annotations

from typing import Any, Optional

import keras

from ...core.errors import CheckpointError

__all__ = ["optimizer_chain", "base_optimizer", "slot_variables", "scalar_state", "set_scalar_state"]


def optimizer_chain(optimizer: Any) -> list[Any]:
    """``optimizer`` and every optimizer under its ``inner_optimizer`` wrappers, outermost first."""
    chain = []
    while optimizer is not None and len(chain) < 16:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "__dict__", {}).get("inner_optimizer")
    return chain


def base_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer: the one whose slots hold the state."""
    return optimizer_chain(optimizer)[-1]


def _prefix(variable: Any) -> str:
    path = getattr(variable, "path", None)
    if path is not None:
        return f"{path.replace('/', '_')}_"
    return f"{str(variable.name).replace('/', '_').replace(':', '_')}_"


def _own_scalars(optimizer: Any) -> list[Any]:
    return [v for v in (getattr(optimizer, "_iterations", None), getattr(optimizer, "_learning_rate", None))
            if isinstance(v, keras.Variable)]


def slot_variables(optimizer: Any) -> list[dict[str, Any]]:
    """Per variable the built ``optimizer`` was built over (its ``_trainable_variables``, in order),
    ``{slot name: slot variable}``; refuses non-scalar variables that are nobody's slot."""
    references = list(getattr(optimizer, "_trainable_variables", []))
    prefixes = sorted(((_prefix(v), i) for i, v in enumerate(references)), key=lambda p: -len(p[0]))
    slots: list[dict[str, Any]] = [{} for _ in references]
    skip = {id(v) for v in _own_scalars(optimizer)}
    for var in optimizer.variables:
        if id(var) in skip:
            continue
        name = str(var.name)
        owner = next((i for prefix, i in prefixes if name.startswith(prefix)
                      and tuple(references[i].shape) == tuple(var.shape)), None)
        if owner is None:
            if tuple(var.shape) == ():
                continue  # a scalar of the optimizer's own: see scalar_state
            raise CheckpointError(f"optimizer variable {name!r} {tuple(var.shape)} of {type(optimizer).__name__} "
                                  "is not the slot of one variable (made by add_variable_from_reference), so a "
                                  "sharded checkpoint cannot place it")
        slot = name[len(_prefix(references[owner])):]
        if slot in slots[owner]:
            raise CheckpointError(f"optimizer {type(optimizer).__name__} has two {slot!r} slots for "
                                  f"{references[owner].path!r}")
        slots[owner][slot] = var
    return slots


def _value(variable: Any) -> Any:
    return keras.ops.convert_to_numpy(variable).item()


def scalar_state(optimizer: Any) -> dict[str, Any]:
    """The scalars to restore: the base optimizer's iterations and learning rate (unless a schedule),
    its other scalar variables, and a loss-scale optimizer's scale and counter."""
    out: dict[str, Any] = {}
    chain = optimizer_chain(optimizer)
    base = chain[-1]
    out["iterations"] = int(_value(base.iterations))
    lr = getattr(base, "_learning_rate", None)
    if isinstance(lr, keras.Variable):
        out["learning_rate"] = float(_value(lr))
    own = {id(v) for v in _own_scalars(base)}
    for var in base.variables:
        if tuple(var.shape) == () and id(var) not in own:
            out[f"base/{var.name}"] = _value(var)
    for opt in chain:
        if isinstance(opt, keras.optimizers.LossScaleOptimizer):
            out["loss_scale/dynamic_scale"] = float(_value(opt.dynamic_scale))
            out["loss_scale/step_counter"] = int(_value(opt.step_counter))
            break
    return out


def set_scalar_state(optimizer: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`scalar_state` returned (entries this optimizer has no place for are skipped)."""
    chain = optimizer_chain(optimizer)
    base = chain[-1]
    if "iterations" in state:
        base.iterations.assign(int(state["iterations"]))
    lr = getattr(base, "_learning_rate", None)
    if isinstance(lr, keras.Variable) and "learning_rate" in state:
        lr.assign(float(state["learning_rate"]))
    own = {id(v) for v in _own_scalars(base)}
    for var in base.variables:
        key = f"base/{var.name}"
        if tuple(var.shape) == () and id(var) not in own and key in state:
            var.assign(state[key])
    scaler: Optional[Any] = next((o for o in chain if isinstance(o, keras.optimizers.LossScaleOptimizer)), None)
    if scaler is not None and "loss_scale/dynamic_scale" in state:
        scaler.dynamic_scale.assign(state["loss_scale/dynamic_scale"])
        scaler.step_counter.assign(state["loss_scale/step_counter"])

