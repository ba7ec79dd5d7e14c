"""A ParallelModel's tensors as whole tensors under their one-process names, one at a time, and back.

Out: :class:`StageTensors` lists what this rank's pipeline stage holds (parameters,
fp32 masters where they differ, optimizer state), and :meth:`StageTensors.stream`
assembles each whole tensor on every rank of the stage (ZeRO shards gathered over
dp, tensor-parallel pieces over tp), one at a time, handing it to a callback; the
stage's ranks take turns keeping them, so that the writing is spread over them. A
parameter two stages hold (tied embeddings) belongs to the first of them.

In: :func:`load_tensors` gives every parameter, master and optimizer state of this
rank its piece of the whole tensors of a source (a checkpoint), reading only its
pieces and, at ZeRO-3, one unit at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from ....core.errors import CheckpointError
from ....core.placement import Placement
from ...torch.zero import ZeroOptimizer
from ...torch.zero.elastic import _gather_flat, _own_slice
from .weights import SafetensorsSource, merge

if TYPE_CHECKING:
    from .parallelize import ParallelModel

__all__ = ["Entry", "StageTensors", "load_tensors", "DTYPE_CODES", "state_key", "master_key"]

DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


def state_key(key: str, name: str) -> str:
    """File name of optimizer state ``key`` of parameter ``name``."""
    return f"optimizer/{key}/{name}"


def master_key(name: str) -> str:
    """File name of the fp32 master of parameter ``name`` (kept where the model is not fp32)."""
    return f"master/{name}"


def _renamed(placement: Placement, name: str) -> Placement:
    """``placement`` for another tensor laid out like it (a parameter's optimizer state)."""
    return dataclasses.replace(placement, name=name)


@dataclass
class Entry:
    """One whole tensor of the stage: file key, shape, dtype, and whether this rank keeps it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mine: bool


@dataclass
class _Item:
    key: str
    placement: Placement
    dtype: torch.dtype
    local: Callable[[], torch.Tensor]  # this rank's (tensor-parallel) piece, once its unit is ready
    replicated_scalar: bool = False


def _stage_ranks(pm: "ParallelModel") -> list[int]:
    every = pm.groups.world.allgather_object(pm.groups.pp_rank)
    return [r for r, s in enumerate(every) if s == pm.groups.pp_rank]


class StageTensors:
    """The whole tensors of this rank's pipeline stage, in one order on every rank of the stage."""

    def __init__(self, pm: "ParallelModel", *, optimizer: bool = True, masters: bool = True) -> None:
        self.pm = pm
        self.ranks = _stage_ranks(pm)
        skip = {id(p) for p, _, _, first in pm._tied if p is not None and first != pm.groups.pp_rank}
        self._units: list[tuple[Callable[[], None], Callable[[], None], list[_Item]]] = []
        opt = pm.optimizer
        if isinstance(opt, ZeroOptimizer):
            for unit in opt.units:
                self._units.append(self._zero_unit(opt, unit, skip, optimizer, masters))
        else:
            items: list[_Item] = []
            seen: set[int] = set()
            for p in pm.module.parameters():
                if id(p) in seen or id(p) in skip:
                    continue
                seen.add(id(p))
                items.extend(self._plain_items(p, opt.state.get(p, {}) if optimizer else {}))
            self._units.append((lambda: None, lambda: None, items))
        flat = [it for _, _, items in self._units for it in items]
        n = len(self.ranks)
        me = self.ranks.index(pm.groups.world.rank)
        self.entries = [Entry(it.key, tuple(it.placement.full_shape), it.dtype, i % n == me)
                        for i, it in enumerate(flat)]

    # -- what the stage holds --------------------------------------------------------------------
    def _plain_items(self, p: nn.Parameter, state: dict) -> list[_Item]:
        name = self.pm.tensors.name(p)
        placement = self.pm.tensors.placement(p)
        items = [_Item(name, placement, p.dtype, lambda p=p: p.detach())]
        for key, value in sorted(state.items()):
            items.append(self._state_item(key, name, placement, value, lambda v=value: v.detach()))
        return items

    @staticmethod
    def _state_item(key: str, name: str, placement: Placement, value: Any,
                    local: Callable[[], torch.Tensor]) -> _Item:
        if not torch.is_tensor(value):
            raise CheckpointError(f"optimizer state {key!r} of {name!r} is a {type(value).__name__}, "
                                  "not a tensor: it cannot be saved")
        if value.dim() == 0:
            return _Item(state_key(key, name), Placement(state_key(key, name), ()), value.dtype, local, True)
        return _Item(state_key(key, name), _renamed(placement, state_key(key, name)), value.dtype, local)

    def _zero_unit(self, opt: ZeroOptimizer, unit: Any, skip: set[int], optimizer: bool,
                   masters: bool) -> tuple[Callable[[], None], Callable[[], None], list[_Item]]:
        full: dict[str, torch.Tensor] = {}
        state = opt.inner.state.get(unit.master, {}) if optimizer else {}
        elementwise = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}

        def prepare() -> None:
            tensors = {f"state/{k}": v for k, v in elementwise.items()}
            if masters and not unit.master_is_shard:
                tensors["master"] = unit.master.detach()
            if unit.stage == 3:
                tensors["parameter"] = unit.shard
            full.update(_gather_flat(unit.comm, tensors) if tensors else {})

        def cut(key: str, slot: Any) -> Callable[[], torch.Tensor]:
            return lambda: full[key][slot.offset: slot.offset + slot.numel].view(slot.shape)

        items: list[_Item] = []
        for slot, p in zip(unit.plan.params, unit.params):
            if id(p) in skip:
                continue
            name = self.pm.tensors.name(p)
            placement = self.pm.tensors.placement(p)
            local = cut("parameter", slot) if unit.stage == 3 else (lambda p=p: p.detach())
            items.append(_Item(name, placement, unit.dtype, local))
            if masters and not unit.master_is_shard:
                items.append(_Item(master_key(name), _renamed(placement, master_key(name)), unit.master.dtype,
                                   cut("master", slot)))
            for key, value in sorted(state.items()):
                local = cut(f"state/{key}", slot) if key in elementwise else (lambda v=value: v.detach())
                items.append(self._state_item(key, name, placement, value, local))
        return prepare, full.clear, items

    # -- streaming ---------------------------------------------------------------------------------
    def stream(self, keep: Callable[[Entry, torch.Tensor], None]) -> None:
        """Collective over the stage: assemble each whole tensor and hand the ones this rank keeps to ``keep``."""
        tp = self.pm.groups.tp
        index = 0
        for prepare, finish, items in self._units:
            prepare()
            for item in items:
                entry = self.entries[index]
                index += 1
                piece = item.local().contiguous()
                if item.placement.sharded:
                    pieces = list(tp.allgather(piece.cpu(), uniform=True).chunk(tp.size))
                    whole = merge(pieces, item.placement)
                else:
                    whole = piece.cpu()
                if entry.mine:
                    keep(entry, whole.contiguous())
            finish()

    def keys(self) -> Iterator[str]:
        return (e.key for e in self.entries)


# -- loading ---------------------------------------------------------------------------------------
def _read(source: SafetensorsSource, key: str, placement: Placement) -> torch.Tensor:
    return source.read(key, _renamed(placement, key))


def _state_keys(source: SafetensorsSource, name: str) -> list[str]:
    prefix = "optimizer/"
    suffix = f"/{name}"
    return sorted(k[len(prefix):-len(suffix)] for k in source.files if k.startswith(prefix) and k.endswith(suffix))


@torch.no_grad()
def load_tensors(pm: "ParallelModel", source: SafetensorsSource, *, optimizer: bool = True) -> None:
    """Set this rank's parameters, masters and optimizer state to its pieces of ``source``'s tensors."""
    opt = pm.optimizer
    if isinstance(opt, ZeroOptimizer):
        _load_zero(pm, opt, source, optimizer)
        return
    seen: set[int] = set()
    for p in pm.module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        name, placement = pm.tensors.name(p), pm.tensors.placement(p)
        p.copy_(_read(source, name, placement).to(p.dtype))
        if not optimizer:
            continue
        state = {}
        for key in _state_keys(source, name):
            k = state_key(key, name)
            shape = source.shape(k)
            state[key] = (source.read(k, Placement(k, shape)) if not shape
                          else _read(source, k, placement)).to(p.device)
        if state:
            opt.state[p] = state
        else:
            opt.state.pop(p, None)


def _load_zero(pm: "ParallelModel", opt: ZeroOptimizer, source: SafetensorsSource, optimizer: bool) -> None:
    opt.wait_parameters()
    opt.reducer.discard()
    for unit in opt.units:
        names = [pm.tensors.name(p) for p in unit.params]
        places = [pm.tensors.placement(p) for p in unit.params]
        slots = [s.name for s in unit.plan.params]
        values = {s: _read(source, n, pl) for s, n, pl in zip(slots, names, places)}
        masters = ({s: _read(source, master_key(n), pl) for s, n, pl in zip(slots, names, places)}
                   if master_key(names[0]) in source.files else values)
        unit.pending = None
        unit.master.grad = None
        unit.master.copy_(_own_slice(unit, masters, unit.master.detach()))
        if unit.stage < 3:
            for slot in unit.plan.params:
                unit.flat[slot.offset: slot.offset + slot.numel].copy_(
                    values[slot.name].reshape(-1).to(unit.flat.device, unit.dtype))
        else:
            if unit.gathered:
                unit.release()
            unit.shard.copy_(_own_slice(unit, values, unit.shard))
        if not optimizer:
            continue
        keys = _state_keys(source, names[0])
        inner: dict[str, Any] = {}
        for key in keys:
            shape = source.shape(state_key(key, names[0]))
            if not shape:
                inner[key] = source.read(state_key(key, names[0]), Placement(state_key(key, names[0]), ()))
                continue
            full = {s: _read(source, state_key(key, n), pl) for s, n, pl in zip(slots, names, places)}
            inner[key] = _own_slice(unit, full, unit.master.detach())
        if inner:
            opt.inner.state[unit.master] = inner
        else:
            opt.inner.state.pop(unit.master, None)
