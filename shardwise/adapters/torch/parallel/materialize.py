"""The model's tensors under their one-process names: placements, and filling meta tensors from a source.

:class:`ModelTensors` is taken from the model after its tensor-parallel split and
before its stages are cut, when every rank still knows every parameter (on the meta
device that costs nothing). It maps each parameter to its canonical name (the first
name of a tied parameter, as ``named_parameters`` and ``save_pretrained`` give it) and
its :class:`~shardwise.core.placement.Placement`, and fills this rank's parameters
from a :class:`~.weights.WeightSource`: all at once, or one ZeRO-3 unit at a time.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch
from torch import nn

from ....core.errors import ConfigError
from ....core.placement import Placement
from .init_replay import InitRecord
from .tp_apply import placement_of
from .weights import WeightSource

__all__ = ["ModelTensors", "materialize_buffers", "is_meta_model", "resolve_build_device", "move_materialized"]

DeviceLike = Union[str, int, torch.device]


def is_meta_model(model: nn.Module) -> bool:
    """True when any parameter of ``model`` is on the meta device."""
    return any(p.is_meta for p in model.parameters())


def _explicit(device: DeviceLike) -> torch.device:
    """``device`` as a torch device; a bare ``"cuda"`` means this rank's current CUDA device."""
    out = torch.device(device)
    if out.type == "cuda" and out.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return out


def resolve_build_device(model: nn.Module, device: Optional[DeviceLike] = None) -> torch.device:
    """Where ``parallelize`` puts ``model``'s parameters, buffers and ZeRO shards.

    ``device`` given: that device (a model that holds no meta parameter must already be on
    it). ``None``: for a model on the meta device, this rank's bound CUDA device
    (``torch.cuda.current_device()``) when CUDA is available, else the CPU; for any other
    model, the device its parameters are on.
    """
    meta = is_meta_model(model)
    present = [p.device for p in model.parameters() if not p.is_meta]
    if device is not None:
        chosen = _explicit(device)
        if chosen.type == "meta":
            raise ConfigError("parallelize cannot materialize a model on the meta device: name a real device")
        if not meta and present and any(d != chosen for d in present):
            raise ConfigError(f"the model's parameters are on {present[0]}, device={chosen}: move the model "
                              f"there first (model.to({str(chosen)!r})) or build it on the meta device")
        return chosen
    if meta and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return present[0] if present else torch.device("cpu")


@torch.no_grad()
def materialize_buffers(model: nn.Module, record: InitRecord, device: DeviceLike = "cpu") -> None:
    """Replace every meta buffer of ``model`` by its value in a normal build (buffers are small),
    computed on the CPU and then put on ``device``."""
    for prefix, module in model.named_modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                value = record.full(f"{prefix}.{name}" if prefix else name)
                module._buffers[name] = value.to(device=device, dtype=buf.dtype, copy=True)


@torch.no_grad()
def move_materialized(model: nn.Module, device: DeviceLike) -> None:
    """Put the parameters and buffers of a (partly) meta ``model`` that are not meta on ``device``."""
    device = torch.device(device)
    for p in model.parameters():
        if not p.is_meta and p.device != device:
            p.data = p.data.to(device)
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[name] = buf.to(device)


def _swap_in(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give a meta parameter ``value`` in place: the same Python object (so ties, hooks and
    optimizer references hold), now on ``value``'s device (``.data =`` cannot change a meta tensor)."""
    hooks = list((param._backward_hooks or {}).values())
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)  # swap_tensors exchanges attributes too
    torch.utils.swap_tensors(param, new)
    # swap_tensors keeps the hook dict but not autograd's registration of it: register them anew
    # (tensor parallelism's gradient sums over tp are such hooks).
    param._backward_hooks = None
    for hook in hooks:
        param.register_hook(hook)


class ModelTensors:
    """Canonical name and placement of every parameter of a (tensor-parallel) model."""

    def __init__(self, model: nn.Module, device: DeviceLike = "cpu") -> None:
        #: Where meta parameters are materialized (their values are computed on the CPU, then moved).
        self.device = torch.device(device)
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
        """Set each parameter (the meta ones, or all) to this rank's piece from ``source``.

        A meta parameter is materialized on :attr:`device`, one piece at a time (the piece is
        read or computed on the CPU, so that the host holds one piece at most)."""
        for p in params:
            if only_meta and not p.is_meta:
                continue
            value = source.local(self.placement(p), p.dtype)
            if tuple(value.shape) != tuple(p.shape) and not p.is_meta:
                raise ConfigError(f"{self.name(p)}: piece of shape {tuple(value.shape)} for a parameter "
                                  f"of shape {tuple(p.shape)}")
            if p.is_meta:
                _swap_in(p, value.to(self.device))
                del value
            else:
                p.data.copy_(value)

    def materializer(self, source: Optional[WeightSource]) -> "UnitMaterializer":
        """A ZeRO unit materializer filling parameters from ``source`` on :attr:`device`."""
        return UnitMaterializer(self, source)


class UnitMaterializer:
    """Fills a ZeRO unit's meta parameters from a source; ``device`` tells ZeRO where they will be."""

    def __init__(self, tensors: ModelTensors, source: Optional[WeightSource]) -> None:
        self.tensors, self.source = tensors, source

    @property
    def device(self) -> torch.device:
        """The device the parameters are materialized on."""
        return self.tensors.device

    def __call__(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        if self.source is None:
            raise ConfigError("parameters on the meta device and no weights to fill them with")
        self.tensors.fill([p for _, p in named], self.source)
