"""What this rank holds of a ParallelModel's tensors, as pieces to save without moving them.

A piece is a contiguous range of row-major elements of a local tensor whose place
in the canonical (one-process) tensor a :class:`~shardwise.core.placement.Placement`
gives: a whole tensor-parallel slice for a plain parameter and its optimizer state,
this rank's range of it for a ZeRO shard (parameters, fp32 masters and state, any
stage). Ranks that hold the same piece (data-parallel replicas, tensor-parallel
replicas, a step count) report the same identity, so that one of them writes it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ....core.errors import CheckpointError
from ....core.placement import Placement
from ...torch.zero import ZeroOptimizer
from .full_tensors import frozen_parameters, master_key, plain_parameters, state_key, tied_elsewhere

if TYPE_CHECKING:
    from .parallelize import ParallelModel

__all__ = ["LocalPiece", "local_pieces"]


@dataclass(frozen=True)
class LocalPiece:
    """Elements ``[start, stop)`` of this rank's local tensor of canonical tensor ``key``."""

    key: str
    placement: Placement
    start: int
    stop: int
    dtype: torch.dtype
    values: Callable[[], torch.Tensor] = dataclasses.field(compare=False)
    """The ``stop - start`` elements, 1-D."""

    @property
    def ident(self) -> tuple:
        """Equal on every rank holding the same values (tensor-parallel replicas of a key/value head too)."""
        p = self.placement.canonical()
        return (self.key, p.full_shape, p.dim, p.parts, p.size, p.rank, p.transpose, p.bounds, p.uneven, self.start,
                self.stop)

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * torch.empty(0, dtype=self.dtype).element_size()


def _renamed(placement: Placement, key: str) -> Placement:
    return dataclasses.replace(placement, name=key)


def _scalar(key: str, name: str, placement: Placement, value: torch.Tensor) -> list[LocalPiece]:
    """A per-parameter scalar state (a step count); vocabulary chunks share their first chunk's."""
    if placement.partial and placement.ranges()[0][0] != 0:
        return []
    k = state_key(key, name)
    return [LocalPiece(k, Placement(k, ()), 0, 1, value.dtype, lambda v=value: v.detach().reshape(1))]


def _not_tensor(key: str, name: str, value: Any) -> CheckpointError:
    return CheckpointError(f"optimizer state {key!r} of {name!r} is a {type(value).__name__}, not a tensor: "
                           "it cannot be saved")


def _plain(pm: "ParallelModel", p: nn.Parameter, state: dict, master: Any = None) -> list[LocalPiece]:
    name, placement = pm.tensors.name(p), pm.tensors.placement(p)
    out = [LocalPiece(name, placement, 0, p.numel(), p.dtype, lambda: p.detach().reshape(-1))]
    if master is not None:
        k = master_key(name)
        out.append(LocalPiece(k, _renamed(placement, k), 0, master.numel(), master.dtype,
                              lambda: master.detach().reshape(-1)))
    for key, value in sorted(state.items()):
        if not torch.is_tensor(value):
            raise _not_tensor(key, name, value)
        if value.dim() == 0:
            out += _scalar(key, name, placement, value)
        else:
            k = state_key(key, name)
            out.append(LocalPiece(k, _renamed(placement, k), 0, value.numel(), value.dtype,
                                  lambda v=value: v.detach().reshape(-1)))
    return out


def _zero_unit(pm: "ParallelModel", opt: ZeroOptimizer, unit: Any, skip: set[int], optimizer: bool,
               masters: bool) -> list[LocalPiece]:
    state = opt.inner.state.get(unit.master, {}) if optimizer else {}
    index = {slot.name: i for i, slot in enumerate(unit.plan.params)}
    named = []
    for slot, p in zip(unit.plan.params, unit.params):
        placement = pm.tensors.placement(p)
        if math.prod(placement.local_shape) != slot.numel:
            raise CheckpointError(f"{pm.tensors.name(p)}: ZeRO holds {slot.numel} elements, its placement "
                                  f"{placement.local_shape}")
        named.append((pm.tensors.name(p), placement))
    flats: list[tuple[Callable[[str], str], torch.Tensor]] = [(lambda n: n, unit.shard)]
    if masters and not unit.master_is_shard:
        flats.append((master_key, unit.master))
    for key, value in sorted(state.items()):
        if not torch.is_tensor(value):
            raise _not_tensor(key, named[0][0], value)
        if value.dim() > 0:
            flats.append((lambda n, key=key: state_key(key, n), value))
    out: list[LocalPiece] = []
    for rank_slice in unit.plan.rank_params(unit.comm.rank):
        i = index[rank_slice.name]
        if id(unit.params[i]) in skip:
            continue
        name, placement = named[i]
        a, b = rank_slice.shard_offset, rank_slice.shard_offset + rank_slice.length
        for to_key, flat in flats:
            k = to_key(name)
            out.append(LocalPiece(k, _renamed(placement, k), rank_slice.param_offset,
                                  rank_slice.param_offset + rank_slice.length, flat.dtype,
                                  lambda flat=flat, a=a, b=b: flat.detach()[a:b]))
    for key, value in sorted(state.items()):
        if value.dim() == 0:  # every rank of the unit holds it, whatever its range
            for p, (name, placement) in zip(unit.params, named):
                if id(p) not in skip:
                    out += _scalar(key, name, placement, value)
    return out


def local_pieces(pm: "ParallelModel", *, optimizer: bool = True, masters: bool = True) -> list[LocalPiece]:
    """Every piece of parameters, fp32 masters and optimizer state this rank holds, in one order.

    A parameter tied across pipeline stages is reported by its first stage only; with ZeRO, the
    parameters no unit holds (frozen ones) are reported whole, as without it.
    """
    skip = tied_elsewhere(pm)
    opt = pm.optimizer
    if isinstance(opt, ZeroOptimizer):
        opt.wait_parameters()
        return ([piece for unit in opt.units for piece in _zero_unit(pm, opt, unit, skip, optimizer, masters)]
                + [piece for p in frozen_parameters(pm, skip) for piece in _plain(pm, p, {})])
    return [piece for p, state, master in plain_parameters(pm, skip, optimizer)
            for piece in _plain(pm, p, state, master if masters else None)]
