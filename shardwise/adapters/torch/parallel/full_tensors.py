"""A ParallelModel's tensors as whole tensors under their one-process names, one at a time, and back.

Out: :class:`StageTensors` lists what this rank's pipeline stage holds (parameters,
fp32 masters where they differ, optimizer state), and :meth:`StageTensors.stream`
assembles each whole tensor on every rank of the stage (ZeRO shards gathered over
dp, tensor-parallel pieces over tp, expert pieces over ep), one at a time, handing it
to a callback; the stage's ranks take turns keeping them, so that the writing is
spread over them. A
parameter two stages hold (tied embeddings) belongs to the first of them.

In: :func:`stage_tensors` reads every parameter, master and optimizer state piece this
rank keeps from a source (a checkpoint) into new tensors, reading only its pieces, and
returns the function that sets them; a load that must be all-or-nothing agrees between
the ranks in between (:mod:`shardwise.checkpoint.agree`). :func:`load_tensors` does both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from ....core.errors import CheckpointError
from ....core.placement import Placement
from ...torch.zero import ZeroOptimizer
from ...torch.zero.elastic import _own_slice
from ..checkpoint.pieces import PiecesSource
from .experts.sharding import is_expert_param
from .master_weights import MasterWeightsOptimizer
from .weights import merge

if TYPE_CHECKING:
    from .parallelize import ParallelModel

__all__ = ["Entry", "StageTensors", "load_tensors", "stage_tensors", "DTYPE_CODES", "state_key", "master_key",
           "frozen_parameters"]

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
    local: Callable[[Optional[torch.Tensor]], torch.Tensor]
    """This rank's (tensor-parallel) piece, given its group's gathered flat buffer (or None)."""
    expert: bool = False
    """A piece of an expert tensor, split over the ep group (:mod:`.expert_parallel`)."""


@dataclass
class _Group:
    """Tensors moved to one writer together: one ZeRO unit's parameters, master or state, or plain ones."""

    items: list[_Item]
    flat: Optional[Callable[[], torch.Tensor]] = None
    """This rank's flat shard (ZeRO), gathered over ``comm`` to the writer's data-parallel rank."""
    comm: Any = None
    writer: int = 0
    expert: bool = False
    """A ZeRO unit of expert parameters: ``comm`` is the expert-data-parallel group."""

    @property
    def nbytes(self) -> int:
        return sum(math.prod(it.placement.full_shape) * torch.empty(0, dtype=it.dtype).element_size()
                   for it in self.items)


def _gather_to(comm: Any, piece: torch.Tensor, root: int,
               placement: Optional[Placement] = None) -> Optional[list[torch.Tensor]]:
    """Every rank's ``piece`` on ``root`` of ``comm``, in rank order; None elsewhere. Pieces have
    ``piece``'s shape, or the local shape ``placement`` gives each tensor-parallel rank."""
    if comm.size == 1:
        return [piece]
    if comm.rank != root:
        comm.send(piece, root)
        return None

    def shape(r: int) -> tuple[int, ...]:
        if placement is None:
            return tuple(piece.shape)
        return dataclasses.replace(placement, rank=r).local_shape

    return [piece if r == root else comm.recv(piece.new_empty(shape(r)), r) for r in range(comm.size)]


def tied_elsewhere(pm: "ParallelModel") -> set[int]:
    """Ids of this rank's parameters that an earlier pipeline stage holds too (it saves them)."""
    return {id(p) for p, _, _, first in pm._tied if p is not None and first != pm.groups.pp_rank}


def plain_parameters(pm: "ParallelModel", skip: set[int],
                     optimizer: bool) -> list[tuple[nn.Parameter, dict, Optional[nn.Parameter]]]:
    """Without ZeRO: each parameter of this rank once (but those in ``skip``), with its optimizer state
    (empty unless ``optimizer``) and its fp32 master (None unless the model is 16-bit)."""
    opt, seen, out = pm.optimizer, set(), []
    for p in pm.module.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        master = opt.master(p) if isinstance(opt, MasterWeightsOptimizer) else None
        out.append((p, opt.state.get(master if master is not None else p, {}) if optimizer else {}, master))
    return out


def frozen_parameters(pm: "ParallelModel", skip: set[int]) -> list[nn.Parameter]:
    """With ZeRO: each parameter of this rank that no ZeRO unit holds (those that need no gradient,
    kept whole on every rank), once, in model order, but those in ``skip``; [] without ZeRO, and for
    a bare ZeroOptimizer's stand-in (the checkpoint door's, whose module is saved on its own)."""
    opt = getattr(pm, "optimizer", None)
    if not isinstance(opt, ZeroOptimizer):
        return []
    held = {id(p) for unit in opt.units for p in unit.params} | set(skip)
    out: list[nn.Parameter] = []
    for p in pm.module.parameters():
        if id(p) not in held:
            held.add(id(p))
            out.append(p)
    return out


class StageTensors:
    """The whole tensors of this rank's pipeline stage, in one order on every rank of the stage.

    Tensors travel in groups (a ZeRO unit's parameters, its master, each optimizer state,
    or all plain parameters with their state); each group goes to one rank of the stage,
    the least loaded in bytes so far, and only to it: ZeRO shards are gathered over dp to
    its data-parallel rank, then tensor-parallel pieces over tp to it.
    """

    def __init__(self, pm: "ParallelModel", *, optimizer: bool = True, masters: bool = True) -> None:
        self.pm = pm
        g = pm.groups
        coords = g.world.allgather_object((g.pp_rank, g.dp_rank, g.tp_rank))
        self.ranks = [r for r, c in enumerate(coords) if c[0] == g.pp_rank]
        self._coords = coords
        skip = tied_elsewhere(pm)
        self._groups: list[_Group] = []
        opt = pm.optimizer
        if isinstance(opt, ZeroOptimizer):
            for unit in opt.units:
                self._groups.extend(self._zero_groups(opt, unit, skip, optimizer, masters))
            for p in frozen_parameters(pm, skip):  # whole on every rank: written like plain ones
                self._groups.append(_Group(self._plain_items(p, {})))
        else:
            for p, state, master in plain_parameters(pm, skip, optimizer):
                self._groups.append(_Group(self._plain_items(p, state, master if masters else None)))
        load = {r: 0 for r in self.ranks}
        owner: dict[str, int] = {}  # a tensor in chunks (several groups) is assembled by one writer
        for group in self._groups:  # the same greedy choice on every rank of the stage
            known = [owner[it.key] for it in group.items if it.key in owner]
            group.writer = known[0] if known else min(self.ranks, key=lambda r: (load[r], r))
            load[group.writer] += group.nbytes
            owner.update((it.key, group.writer) for it in group.items if it.placement.partial)
        me = g.world.rank
        # A chunked tensor is complete, and written, when its last chunk arrives.
        self._chunks_left = {}
        for grp in self._groups:
            for it in grp.items:
                if it.placement.partial:
                    self._chunks_left[it.key] = self._chunks_left.get(it.key, 0) + 1
        left = dict(self._chunks_left)
        self.entries = []
        for grp in self._groups:
            for it in grp.items:
                if it.placement.partial:
                    left[it.key] -= 1
                    if left[it.key]:
                        continue
                self.entries.append(Entry(it.key, tuple(it.placement.full_shape), it.dtype, grp.writer == me))

    # -- what the stage holds --------------------------------------------------------------------
    def _plain_items(self, p: nn.Parameter, state: dict, master: Optional[nn.Parameter] = None) -> list[_Item]:
        name = self.pm.tensors.name(p)
        placement = self.pm.tensors.placement(p)
        items = [_Item(name, placement, p.dtype, lambda _, p=p: p.detach())]
        if master is not None:
            items.append(_Item(master_key(name), _renamed(placement, master_key(name)), master.dtype,
                               lambda _, m=master: m.detach()))
        for key, value in sorted(state.items()):
            items.append(self._state_item(key, name, placement, value, lambda _, v=value: v.detach()))
        items = [it for it in items if it is not None]
        if is_expert_param(p):
            for it in items:
                it.expert = it.placement.sharded
        return items

    @staticmethod
    def _state_item(key: str, name: str, placement: Placement, value: Any,
                    local: Callable[[Optional[torch.Tensor]], torch.Tensor]) -> Optional[_Item]:
        if not torch.is_tensor(value):
            raise CheckpointError(f"optimizer state {key!r} of {name!r} is a {type(value).__name__}, "
                                  "not a tensor: it cannot be saved")
        if value.dim() == 0:  # a chunked parameter's chunks share one step count: the first one's is saved
            if placement.partial and placement.ranges()[0][0] != 0:
                return None
            return _Item(state_key(key, name), Placement(state_key(key, name), ()), value.dtype, local)
        return _Item(state_key(key, name), _renamed(placement, state_key(key, name)), value.dtype, local)

    def _zero_groups(self, opt: ZeroOptimizer, unit: Any, skip: set[int], optimizer: bool,
                     masters: bool) -> list[_Group]:
        state = opt.inner.state.get(unit.master, {}) if optimizer else {}
        slots = [(slot, p) for slot, p in zip(unit.plan.params, unit.params) if id(p) not in skip]

        def cut(slot: Any) -> Callable[[Optional[torch.Tensor]], torch.Tensor]:
            return lambda full: full[slot.offset: slot.offset + slot.numel].view(slot.shape)

        def named(p: nn.Parameter) -> tuple[str, Placement]:
            return self.pm.tensors.name(p), self.pm.tensors.placement(p)

        params = [_Item(*named(p), unit.dtype, cut(slot) if unit.stage == 3 else (lambda _, p=p: p.detach()))
                  for slot, p in slots]
        groups = [_Group(params, (lambda: unit.shard) if unit.stage == 3 else None, unit.comm)]
        if masters and not unit.master_is_shard:
            items = [_Item(master_key(n), _renamed(pl, master_key(n)), unit.master.dtype, cut(slot))
                     for slot, p in slots for n, pl in [named(p)]]
            groups.append(_Group(items, lambda: unit.master.detach(), unit.comm))
        for key, value in sorted(state.items()):
            elementwise = torch.is_tensor(value) and value.dim() > 0
            items = [it for slot, p in slots for n, pl in [named(p)]
                     for it in [self._state_item(key, n, pl, value, cut(slot) if elementwise else (lambda _, v=value: v))]
                     if it is not None]
            groups.append(_Group(items, (lambda v=value: v.detach()) if elementwise else None, unit.comm))
        if any(is_expert_param(p) for _, p in slots):  # a unit of experts: sharded over edp, split over ep
            for grp in groups:
                grp.expert = True
                for it in grp.items:
                    it.expert = it.placement.sharded
        return [grp for grp in groups if grp.items]

    # -- streaming ---------------------------------------------------------------------------------
    def stream(self, keep: Callable[[Entry, torch.Tensor], None]) -> None:
        """Collective over the stage: assemble each whole tensor on its writer, which hands it to ``keep``."""
        g = self.pm.groups
        entries = iter(self.entries)
        left = dict(self._chunks_left)
        assembling: dict[str, torch.Tensor] = {}
        for group in self._groups:
            _, dp_w, tp_w = self._coords[group.writer]
            full = None
            if group.flat is not None:
                # an expert unit's edp group of the writer's ep group gathers it (edp rank = dp rank // ep)
                # (hybrid sharding: every shard group gathers, the writer's keeps it below)
                root = dp_w // g.ep_size if group.expert else dp_w % group.comm.size
                parts = _gather_to(group.comm, group.flat().contiguous().cpu(), root)
                full = torch.cat(parts) if parts is not None else None
            for item in group.items:
                if item.placement.partial:
                    left[item.key] -= 1
                entry = next(entries) if not item.placement.partial or not left[item.key] else None
                if item.expert:  # the writer's expert-parallel group assembles it (experts: whole over tp)
                    if g.tp_rank == tp_w and g.dp_rank // g.ep_size == dp_w // g.ep_size:
                        pieces = _gather_to(g.ep, item.local(full).contiguous().cpu(), dp_w % g.ep_size,
                                            item.placement)
                        if pieces is not None:
                            keep(entry, merge(pieces, item.placement).contiguous())
                    continue
                if g.dp_rank != dp_w:
                    continue  # the writer's data-parallel row assembles this group
                piece = item.local(full).contiguous().cpu()
                if item.placement.sharded:
                    pieces = _gather_to(g.tp, piece, tp_w, item.placement)
                    whole = merge(pieces, item.placement) if pieces is not None else None
                else:
                    whole = piece if g.tp_rank == tp_w else None
                if whole is not None and item.placement.partial:
                    (start, stop), = item.placement.bounds
                    buf = assembling.setdefault(item.key, torch.empty(item.placement.full_shape, dtype=whole.dtype))
                    buf.narrow(item.placement.dim, start, stop - start).copy_(whole)
                    whole = assembling.pop(item.key) if entry is not None else None
                if whole is not None:
                    keep(entry, whole.contiguous())


# -- loading ---------------------------------------------------------------------------------------
def _read(source: PiecesSource, key: str, placement: Placement) -> torch.Tensor:
    return source.read(key, _renamed(placement, key))


def _state_keys(source: PiecesSource, name: str) -> list[str]:
    prefix = "optimizer/"
    suffix = f"/{name}"
    return sorted(k[len(prefix):-len(suffix)] for k in source.files if k.startswith(prefix) and k.endswith(suffix))


@torch.no_grad()
def load_tensors(pm: "ParallelModel", source: PiecesSource, *, optimizer: bool = True) -> None:
    """Set this rank's parameters, masters and optimizer state to its pieces of ``source``'s tensors."""
    stage_tensors(pm, source, optimizer=optimizer)()


@torch.no_grad()
def stage_tensors(pm: "ParallelModel", source: PiecesSource, *, optimizer: bool = True) -> Callable[[], None]:
    """Read this rank's pieces of ``source``'s tensors into new tensors, changing nothing of ``pm``;
    returns the function that then sets the parameters, masters and optimizer state to them.

    A read that fails raises here, before any state changed (all-or-nothing loads).
    """
    opt = pm.optimizer
    if isinstance(opt, ZeroOptimizer):
        return _stage_zero(pm, opt, source, optimizer)
    staged: list[tuple[nn.Parameter, torch.Tensor, Optional[nn.Parameter], Optional[torch.Tensor], dict]] = []
    seen: set[int] = set()
    for p in pm.module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        name, placement = pm.tensors.name(p), pm.tensors.placement(p)
        value = _read(source, name, placement).to(p.dtype)
        master = opt.master(p) if isinstance(opt, MasterWeightsOptimizer) else None
        master_value = None
        if master is not None:
            from_key = master_key(name) if master_key(name) in source.files else name
            master_value = _read(source, from_key, placement).to(master.dtype)
        state: dict[str, torch.Tensor] = {}
        if optimizer:
            for key in _state_keys(source, name):
                k = state_key(key, name)
                shape = source.shape(k)
                state[key] = (source.read(k, Placement(k, shape)) if not shape
                              else _read(source, k, placement)).to(p.device)
        staged.append((p, value, master, master_value, state))

    def apply() -> None:
        with torch.no_grad():
            for p, value, master, master_value, state in staged:
                p.copy_(value)
                if master is not None:
                    master.copy_(master_value)
                if not optimizer:
                    continue
                holder = master if master is not None else p
                if state:
                    opt.state[holder] = state
                else:
                    opt.state.pop(holder, None)
    return apply


def _shard_of(source: PiecesSource, unit: Any, keys: list[str], places: list[Placement],
              like: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's shard of the unit's flat buffer of tensors ``keys``, reading only what it covers,
    into ``out`` when given (else a new tensor like ``like``).

    A tensor this rank holds whole (no tensor-parallel split) is read by element range, straight
    into the shard where the checkpoint holds it as flat pieces, else row by row: only the rows
    that overlap the rank's range, so a ZeRO-3 rank reads about 1/N of each tensor.
    """
    if out is None:
        out = torch.empty(unit.end - unit.start, dtype=like.dtype, device=like.device)
    index = {slot.name: i for i, slot in enumerate(unit.plan.params)}
    at = 0
    for piece in unit.plan.rank_params(unit.comm.rank):
        out[at: piece.shard_offset].zero_()  # alignment padding between parameters
        at = piece.shard_offset + piece.length
        i = index[piece.name]
        shape, placement, key = unit.plan.params[i].shape, places[i], keys[i]
        dst = out[piece.shard_offset: at]
        whole = placement.dim is None and not placement.transpose
        if whole and source.read_flat_into(key, piece.param_offset, dst):
            continue
        if whole and shape:
            row = math.prod(shape[1:])
            first, last = piece.param_offset // row, -(-(piece.param_offset + piece.length) // row)
            rows = source.read_rows(key, placement.full_shape, first, last).reshape(-1)
            values = rows[piece.param_offset - first * row: piece.param_offset - first * row + piece.length]
        else:
            values = _read(source, key, placement).reshape(-1)[piece.param_offset: piece.param_offset + piece.length]
        dst.copy_(values)
    out[at:].zero_()
    return out


def _stage_zero(pm: "ParallelModel", opt: ZeroOptimizer, source: PiecesSource,
                optimizer: bool) -> Callable[[], None]:
    """:func:`stage_tensors` for a ZeRO optimizer: each unit's shard (or flat buffer), master and state."""
    opt.wait_parameters()
    staged = []
    for unit in opt.units:
        names = [pm.tensors.name(p) for p in unit.params]
        places = [pm.tensors.placement(p) for p in unit.params]
        master_names = [master_key(n) for n in names] if master_key(names[0]) in source.files else names
        flat: Optional[dict[str, torch.Tensor]] = None
        shard: Optional[torch.Tensor] = None
        master: Optional[torch.Tensor] = None
        if unit.stage < 3:
            values = {s.name: _read(source, n, pl) for s, n, pl in zip(unit.plan.params, names, places)}
            masters = ({s.name: _read(source, n, pl) for s, n, pl in zip(unit.plan.params, master_names, places)}
                       if master_names is not names else values)
            master = _own_slice(unit, masters, unit.master.detach())
            flat = values
        else:
            shard = _shard_of(source, unit, names, places, unit.shard)
            if not unit.master_is_shard:
                master = _shard_of(source, unit, master_names, places, unit.master)
        inner: dict[str, Any] = {}
        if optimizer:
            for key in _state_keys(source, names[0]):
                k0 = state_key(key, names[0])
                shape = source.shape(k0)
                inner[key] = (source.read(k0, Placement(k0, ())) if not shape else
                              _shard_of(source, unit, [state_key(key, n) for n in names], places, unit.master.detach()))
        staged.append((unit, flat, shard, master, inner))
    frozen = [(p, _read(source, pm.tensors.name(p), pm.tensors.placement(p)).to(p.dtype))
              for p in frozen_parameters(pm, set())]

    def apply() -> None:
        opt.reducer.discard()
        with torch.no_grad():
            for p, value in frozen:
                p.copy_(value)
            for unit, flat, shard, master, inner in staged:
                unit.pending = None
                unit.master.grad = None
                if unit.stage < 3:
                    unit.master.copy_(master)
                    for slot in unit.plan.params:
                        unit.flat[slot.offset: slot.offset + slot.numel].copy_(
                            flat[slot.name].reshape(-1).to(unit.flat.device, unit.dtype))
                else:
                    if unit.gathered:
                        unit.release()
                    unit.shard.copy_(shard)
                    if master is not None:
                        unit.master.copy_(master)
                if not optimizer:
                    continue
                if inner:
                    opt.inner.state[unit.master] = inner
                else:
                    opt.inner.state.pop(unit.master, None)
    return apply
