"""A Keras model's and optimizer's state as flat tensors: the pieces this rank holds, and where loaded values go.

Tensor ``v{i}`` is the model's ``i``-th variable (``model.variables`` order) and
``v{i}/{slot}`` its optimizer slot of that name (:mod:`.slots`). What a rank holds
of each depends on how it trains:

* replicated values (plain or :class:`~.optimizer.DistributedOptimizer` training,
  the model's variables at ZeRO stages 1 and 2, non-trainable variables): every
  rank holds all of it and writes an even ``1/N`` slice;
* ZeRO's sharded values (the slots at every stage, the trainable variables at
  stage 3): each rank writes the pieces of its unit shards, as its
  :class:`~shardwise.core.zero.PartitionPlan` places them.

Loading reads back, whatever the layout it was written in, exactly what this
rank holds in its own layout: whole tensors, or the ranges of its shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import keras
import numpy as np

from ...checkpoint.flat import FlatReader, PieceWriter, even_range
from ...checkpoint.state import check_mismatch
from ...core.errors import CheckpointError
from .hooks import find_distributed_optimizer
from .slots import base_optimizer, scalar_state, set_scalar_state, slot_variables
from .zero.optimizer import ZeroOptimizer

__all__ = ["TrainingState", "match_variables", "describe_variables"]


def describe_variables(variables: Sequence[Any]) -> list[dict[str, Any]]:
    """Path, shape, dtype and trainability of each variable (the checkpoint's variable table)."""
    return [{"path": str(v.path), "shape": [int(d) for d in v.shape],
             "dtype": keras.backend.standardize_dtype(v.dtype), "trainable": bool(v.trainable)} for v in variables]


def match_variables(saved: Sequence[dict[str, Any]], variables: Sequence[Any]) -> list[int]:
    """For each of ``variables``, the index of the saved variable it loads from.

    Variables match in order when every shape agrees in order (auto-generated layer
    names such as ``dense_3`` depend on what the process built before, so paths
    may differ between the saving and the loading process); otherwise by path.
    Anything else is refused, naming the differences.
    """
    mine = describe_variables(variables)
    if len(mine) == len(saved) and all(a["shape"] == list(b["shape"]) for a, b in zip(mine, saved)):
        return list(range(len(mine)))
    by_path = {s["path"]: i for i, s in enumerate(saved)}
    paths = [m["path"] for m in mine]
    if len(by_path) == len(saved) == len(mine) and set(paths) == set(by_path) and len(set(paths)) == len(paths):
        check_mismatch({m["path"]: m["shape"] for m in mine}, {s["path"]: s["shape"] for s in saved},
                       what="checkpoint")
        return [by_path[p] for p in paths]
    first = next((i for i, (a, b) in enumerate(zip(mine, saved)) if a["shape"] != list(b["shape"])),
                 min(len(mine), len(saved)))
    message = (f"checkpoint does not match the model ({len(mine)} model variables, {len(saved)} in the checkpoint): "
               f"variable {first} is {_show(mine, first)} in the model, {_show(saved, first)} in the checkpoint")
    if set(paths) & set(by_path):  # the same names: say which differ by name too
        try:
            check_mismatch({m["path"]: m["shape"] for m in mine}, {s["path"]: s["shape"] for s in saved},
                           what="checkpoint")
        except CheckpointError as exc:
            message += f"; by name, {str(exc).split(': ', 1)[1]}"
    raise CheckpointError(message)


def _show(entries: Sequence[dict[str, Any]], i: int) -> str:
    return f"{entries[i]['path']} {tuple(entries[i]['shape'])}" if i < len(entries) else "absent"


def _numpy(variable: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable))


def _host(value: Any, dtype: str) -> np.ndarray:
    """``value`` as a numpy array of ``dtype`` where numpy has that dtype (Keras casts the rest on assign)."""
    try:
        return np.asarray(value).astype(np.dtype(dtype), copy=False)
    except TypeError:
        return np.asarray(value)


def _dtype(variable: Any) -> str:
    return keras.backend.standardize_dtype(variable.dtype)


@dataclass
class _Place:
    """One piece of a ZeRO unit shard: model variable ``var`` (model index), its elements
    ``[start, start + length)``, at ``offset`` in the shard."""

    var: int
    start: int
    offset: int
    length: int


class TrainingState:
    """The state of ``model`` (and of ``model.optimizer`` unless ``with_optimizer`` is false) on rank
    ``rank`` of ``size``: what it writes (:meth:`write`) and how it takes loaded values (:meth:`restore`).

    An optimizer not built yet is built first, as ``fit`` would (collective for ZeRO).
    """

    def __init__(self, model: Any, rank: int, size: int, *, with_optimizer: bool = True) -> None:
        self.model = model
        self.rank, self.size = rank, size
        self.variables = list(model.variables)
        self._index = {id(v): i for i, v in enumerate(self.variables)}
        self.optimizer = getattr(model, "optimizer", None) if with_optimizer else None
        if self.optimizer is not None and not self.optimizer.built:
            if model.trainable_variables:
                self.optimizer.build(model.trainable_variables)
            else:
                self.optimizer = None
        dist = find_distributed_optimizer(model)
        self.zero: Optional[ZeroOptimizer] = dist if isinstance(dist, ZeroOptimizer) and dist.built else None
        self.stage = self.zero.stage if self.zero is not None else 0
        if self.stage == 3:  # as fit would: the engine governs the model's variables from now on
            self.zero.attach_model(model)
        self._units = list(self.zero.units) if self.zero is not None else []
        if self._units and self._units[0].plan.world_size != size:
            raise CheckpointError(f"the ZeroOptimizer shards over {self._units[0].plan.world_size} ranks, the "
                                  f"checkpoint is written by {size}: save with the optimizer's communicator")
        trainable = list(self.zero._trainable_variables) if self.zero is not None else []
        #: per unit, the model index of each member, and this rank's pieces of the unit's flat buffer
        self._members = [[self._model_index(trainable[m]) for m in u.members] for u in self._units]
        self._places = [self._unit_places(u, members) for u, members in zip(self._units, self._members)]
        self._sharded_values = {v for members in self._members for v in members} if self.stage == 3 else set()

    # -- layout -----------------------------------------------------------------------------
    def _model_index(self, variable: Any) -> int:
        try:
            return self._index[id(variable)]
        except KeyError:
            raise CheckpointError(f"optimizer variable {getattr(variable, 'path', variable)!r} is not a variable "
                                  "of the model") from None

    def _unit_places(self, unit: Any, members: list[int]) -> list[_Place]:
        by_name = dict(zip((s.name for s in unit.plan.params), members))
        return [_Place(by_name[p.name], p.param_offset, p.shard_offset, p.length)
                for p in unit.plan.rank_params(self.rank)]

    def _slots(self) -> list[tuple[Any, dict[str, Any]]]:
        """(what the base optimizer was built over: a model variable, or a ZeRO unit; its slots)."""
        base = base_optimizer(self.zero if self.zero is not None else self.optimizer)
        refs = list(getattr(base, "_trainable_variables", []))
        slots = slot_variables(base)
        if self.zero is None:
            return list(zip(refs, slots))
        units = {id(u.shard): j for j, u in enumerate(self._units)}
        try:
            return [(units[id(r)], s) for r, s in zip(refs, slots)]
        except KeyError:
            raise CheckpointError("the ZeroOptimizer's inner optimizer is not built over its unit shards") from None

    def slot_table(self) -> dict[str, list[str]]:
        """Model index -> slot names, for the trainable variables that have slots."""
        if self.optimizer is None:
            return {}
        out: dict[str, list[str]] = {}
        for ref, slots in self._slots():
            names = sorted(slots)
            if not names:
                continue
            for i in (self._members[ref] if self.zero is not None else [self._model_index(ref)]):
                out[str(i)] = names
        return out

    def scalars(self) -> dict[str, Any]:
        return scalar_state(self.optimizer) if self.optimizer is not None else {}

    # -- saving -----------------------------------------------------------------------------
    def write(self) -> PieceWriter:
        """This rank's pieces of every tensor."""
        out = PieceWriter(self.rank)
        for i, var in enumerate(self.variables):
            if i in self._sharded_values:
                continue  # its pieces come from the unit shards below
            self._add_even(out, f"v{i}", var, var)
        if self.optimizer is None:
            return out
        for ref, slots in self._slots():
            if self.zero is None:
                for name, slot in slots.items():
                    self._add_even(out, f"v{self._model_index(ref)}/{name}", ref, slot)
                continue
            for name, slot in slots.items():
                self._add_shard(out, f"/{name}", ref, slot)
        if self.stage == 3:
            for j, unit in enumerate(self._units):
                self._add_shard(out, "", j, unit.shard)
        return out

    def _add_even(self, out: PieceWriter, key: str, like: Any, variable: Any) -> None:
        numel = int(np.prod(tuple(like.shape), dtype=np.int64))
        start, stop = even_range(numel, self.rank, self.size)
        out.add(key, tuple(like.shape), _dtype(variable), start, _numpy(variable).reshape(-1)[start:stop])

    def _add_shard(self, out: PieceWriter, suffix: str, unit: int, variable: Any) -> None:
        values = _numpy(variable)
        for i in self._members[unit]:
            out.declare(f"v{i}{suffix}", tuple(self.variables[i].shape), _dtype(variable))
        for p in self._places[unit]:
            out.add(f"v{p.var}{suffix}", tuple(self.variables[p.var].shape), _dtype(variable), p.start,
                    values[p.offset:p.offset + p.length])

    # -- loading ----------------------------------------------------------------------------
    def restore(self, reader: FlatReader, saved_variables: Sequence[dict[str, Any]],
                saved_slots: Optional[dict[str, list[str]]], saved_scalars: dict[str, Any]) -> None:
        """Take this rank's values from ``reader``; ``saved_slots`` None: the checkpoint has no optimizer state."""
        self.stage_values(reader, saved_variables, saved_slots, saved_scalars)()

    def stage_values(self, reader: FlatReader, saved_variables: Sequence[dict[str, Any]],
                     saved_slots: Optional[dict[str, list[str]]],
                     saved_scalars: dict[str, Any]) -> Callable[[], None]:
        """Read and check every value this rank needs from ``reader``, assigning nothing; returns the
        function that assigns them (so that a load can agree between the ranks in between).

        The values are not kept between the two: each is read (and its checksums checked) here into
        a buffer that is dropped at once, and read again by the returned function, one at a time, from
        ``reader`` (which must stay open until it returns). So a ZeRO-3 load's peak stays about one
        shard above the model's, not a copy of the whole rank's state.
        """
        source = match_variables(saved_variables, self.variables)
        if self.optimizer is not None:  # refuse before anything is read
            if saved_slots is None:
                raise CheckpointError("the checkpoint holds no optimizer state; load it with "
                                      "include_optimizer=False to take the model's values only")
            self._check_slots(saved_slots, source)
        reads: list[tuple[Any, Callable[[], np.ndarray]]] = []

        def whole(target: Any, key: str) -> None:
            reads.append((target, lambda: _host(reader.read_whole(key), _dtype(target))))

        def shard(target: Any, unit: int, suffix: str) -> None:
            reads.append((target, lambda: self._read_shard(target, reader, unit, source, suffix)))

        for i, var in enumerate(self.variables):
            if i not in self._sharded_values:
                whole(var, f"v{source[i]}")
        if self.stage == 3:
            for j, unit in enumerate(self._units):
                shard(unit.shard, j, "")
        if self.optimizer is not None:
            for ref, slots in self._slots():
                for name, slot in slots.items():
                    if self.zero is None:
                        whole(slot, f"v{source[self._model_index(ref)]}/{name}")
                    else:
                        shard(slot, ref, f"/{name}")
        for _, read in reads:
            read()

        def apply() -> None:
            for target, read in reads:
                target.assign(read())
            if self.optimizer is not None:
                set_scalar_state(self.optimizer, saved_scalars)
            if self.stage == 3:
                self.zero.stage3_engine.shards_changed()
        return apply

    def _read_shard(self, target: Any, reader: FlatReader, unit: int, source: list[int], suffix: str) -> np.ndarray:
        """This rank's ranges of ``v{k}{suffix}`` laid out as ``target`` (a unit-sized shard variable); padding
        is zero."""
        out = _host(np.zeros(tuple(target.shape), np.float32), _dtype(target))
        reader.read_into(out, [(f"v{source[p.var]}{suffix}", p.start, p.offset, p.length)
                               for p in self._places[unit]])
        return out

    def _check_slots(self, saved: dict[str, list[str]], source: list[int]) -> None:
        for i, names in sorted(self.slot_table().items(), key=lambda kv: int(kv[0])):
            theirs = saved.get(str(source[int(i)]))
            if theirs != names:
                inner = type(base_optimizer(self.optimizer)).__name__
                raise CheckpointError(
                    f"the checkpoint's optimizer state of {self.variables[int(i)].path!r} has slots {theirs}, this "
                    f"{inner} has {names}: resume with the optimizer class that wrote it, or load with "
                    "include_optimizer=False to take the model's values only")
