"""Weight regularizers of Keras layers trained with ZeRO stage 3 on the torch backend.

Keras computes a variable's penalty (``kernel_regularizer=...``) after the forward, from
the variable itself, and lets autograd carry its gradient. Under stage 3 the variable is
whole only while its layer runs, so both parts move to where it is gathered:

* the value is computed in the layer's forward, without a graph, and is what the
  model's ``losses`` report for it (so the loss ``fit`` and ``evaluate`` print includes it);
* its gradient is computed when the layer's gradient is complete, on the variable that
  the backward gathered again, and added to the unit's flat gradient before the
  reduce-scatter, multiplied by the loss scale (the one the optimizer's
  ``scale_loss`` applies). Every rank adds the same term, so the averaged gradient
  gets it once, as one process does.

As on the JAX backend, a layer not called in a step adds no penalty in that step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import keras
import torch

from ....torch.compiling import not_traced
from ..access import engine_of

__all__ = ["Penalties", "install_penalties"]

_MARK = "__shardwise_zero3_penalties__"


class Penalties:
    """The regularized variables of each unit, and this step's penalty values and due gradients."""

    def __init__(self, by_unit: dict[int, list[tuple[int, Any]]], scale: Callable[[], float]) -> None:
        #: unit index -> (position in the unit, Keras variable) of each regularized variable
        self.by_unit = {i: members for i, members in by_unit.items() if members}
        self._scale_of_step = scale
        self._values: dict[int, torch.Tensor] = {}  # variable id -> its penalty in this step
        self._due: set[int] = set()  # units whose penalty gradient this backward still adds
        self._scale: Optional[float] = None

    def new_step(self) -> None:
        """A forward of the whole model begins: last step's values and gradients are over."""
        self._values.clear()
        self._due.clear()
        self._scale = None

    @not_traced  # under jit_compile=True: a graph break, the value computed eagerly
    def computed_in_forward(self, index: int, params: list[torch.Tensor]) -> None:
        """Unit ``index`` is gathered for its layer's forward: its penalties' values, and their gradients due."""
        members = self.by_unit.get(index)
        if not members:
            return
        if torch.is_grad_enabled():
            self._due.add(index)
        with torch.no_grad():
            for position, variable in members:
                self._values[id(variable)] = variable.regularizer(params[position])

    def due(self, index: int) -> bool:
        return index in self._due

    def add_gradients(self, index: int, params: list[torch.Tensor], plan: Any, flat: torch.Tensor) -> None:
        """Add the (loss-scaled) gradient of unit ``index``'s penalties to its flat gradient, once per step."""
        self._due.discard(index)
        if self._scale is None:
            self._scale = self._scale_of_step()
        with torch.enable_grad():
            for position, variable in self.by_unit[index]:
                leaf = params[position].detach().requires_grad_()
                (grad,) = torch.autograd.grad(variable.regularizer(leaf), leaf)
                slot = plan.params[position]
                flat[slot.offset: slot.offset + slot.numel].view(slot.shape).add_(grad, alpha=self._scale)

    @not_traced
    def losses(self, layer: Any, sharded: Callable[[Any], bool]) -> list[Any]:
        """``layer``'s weight penalties: this step's values for sharded variables, computed as Keras does for others."""
        out = []
        for variable in layer.trainable_weights:
            if variable.regularizer is None:
                continue
            if not sharded(variable):
                out.append(variable.regularizer(variable))
            elif id(variable) in self._values:
                out.append(self._values[id(variable)])
        return out


def install_penalties() -> None:
    """Let layers of a torch stage-3 engine report its penalties as their regularization losses (idempotent)."""
    original = keras.layers.Layer._get_regularization_losses
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def regularization_losses(self: Any) -> list[Any]:
        engine = engine_of(self)
        penalties = getattr(engine, "regularization_losses", None)
        return penalties(self) if penalties is not None else original(self)

    setattr(regularization_losses, _MARK, True)
    keras.layers.Layer._get_regularization_losses = regularization_losses
