"""The model's tensors under their one-process names: placements, and filling meta tensors from a source.

:class:`ModelTensors` is taken from the model after its tensor-parallel split and
before its stages are cut, when every rank still knows every parameter (on the meta
device that costs nothing). It maps each parameter to its canonical name (the first
name of a tied parameter, as ``named_parameters`` and ``save_pretrained`` give it) and
its :class:`~shardwise.core.placement.Placement`, and fills this rank's parameters
from a :class:`~.weights.WeightSource`: all at once, or one ZeRO-3 unit at a time.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from ....core.errors import ConfigError
from ....core.placement import Placement
from .init_replay import InitRecord
from .tp_apply import placement_of
from .weights import WeightSource

__all__ = ["ModelTensors", "materialize_buffers", "is_meta_model"]


def is_meta_model(model: nn.Module) -> bool:
    """True when any parameter of ``model`` is on the meta device."""
    return any(p.is_meta for p in model.parameters())


@torch.no_grad()
def materialize_buffers(model: nn.Module, record: InitRecord) -> None:
    """Replace every meta buffer of ``model`` by its value in a normal build (buffers are small)."""
    for prefix, module in model.named_modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                value = record.full(f"{prefix}.{name}" if prefix else name)
                module._buffers[name] = value.to(buf.dtype).clone()


def _swap_in(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give a meta parameter ``value`` in place: the same Python object (so ties, hooks and
    optimizer references hold), now on ``value``'s device (``.data =`` cannot change a meta tensor)."""
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)  # swap_tensors exchanges attributes too
    torch.utils.swap_tensors(param, new)


class ModelTensors:
    """Canonical name and placement of every parameter of a (tensor-parallel) model."""

    def __init__(self, model: nn.Module) -> None:
        self.placements: dict[int, Placement] = {}
        for name, p in model.named_parameters():
            self.placements[id(p)] = placement_of(p, name)

    @property
    def expected(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> full shape, for every parameter of the model."""
        return {pl.name: pl.full_shape for pl in self.placements.values()}

    def placement(self, p: torch.Tensor) -> Placement:
        try:
            return self.placements[id(p)]
        except KeyError:
            raise ConfigError("a parameter of this rank is not a parameter of the model passed to "
                              "parallelize") from None

    def name(self, p: torch.Tensor) -> str:
        """The one-process name of the tensor ``p`` holds (a piece of)."""
        return self.placement(p).name

    @torch.no_grad()
    def fill(self, params: Iterable[nn.Parameter], source: WeightSource, *, only_meta: bool = True) -> None:
        """Set each parameter (the meta ones, or all) to this rank's piece from ``source``."""
        for p in params:
            if only_meta and not p.is_meta:
                continue
            value = source.local(self.placement(p), p.dtype)
            if tuple(value.shape) != tuple(p.shape) and not p.is_meta:
                raise ConfigError(f"{self.name(p)}: piece of shape {tuple(value.shape)} for a parameter "
                                  f"of shape {tuple(p.shape)}")
            if p.is_meta:
                _swap_in(p, value)
            else:
                p.data.copy_(value)

    def materializer(self, source: Optional[WeightSource]):  # noqa: ANN201 - a Materializer
        """A ZeRO unit materializer filling parameters from ``source``."""
        def fill(named: Sequence[tuple[str, nn.Parameter]]) -> None:
            if source is None:
                raise ConfigError("parameters on the meta device and no weights to fill them with")
            self.fill([p for _, p in named], source)
        return fill
