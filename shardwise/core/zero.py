"""The ZeRO partition plan: which rank owns which elements of the flat parameter buffer.

Parameters are laid out back to back, in the given order, in one flat buffer.
The buffer is padded with zeros at the end so that its length ``padded_numel``
is a multiple of ``world_size * alignment``; rank ``r`` owns the contiguous
range ``[r * shard_numel, (r + 1) * shard_numel)`` with
``shard_numel = padded_numel // world_size`` (a multiple of ``alignment``).
Padding lives only at the tail, so it belongs to the highest ranks.

This is the layout of DeepSpeed's ZeRO stage 1/2 (one flat group, equal
partitions), framework neutral: the plan is pure arithmetic on names and shapes,
so every rank that builds it from the same inputs gets the same plan.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence, Union

import numpy as np

from .errors import ConfigError

__all__ = [
    "PartitionError", "ParamSlot", "Segment", "RankSlice", "PartitionPlan",
    "flatten", "unflatten", "shard_of", "unshard", "reshard",
]

#: Version of the ``to_dict`` format and of the fingerprint recipe.
PLAN_FORMAT_VERSION = 1

ParamSpec = Union[int, Sequence[int]]


class PartitionError(ConfigError):
    """Arrays, shards or a serialised plan that do not match a partition plan."""


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"{what} must be an integer, got {value!r}") from None


def _as_shape(spec: ParamSpec, name: str) -> tuple[int, ...]:
    if isinstance(spec, (Sequence, np.ndarray)) and not isinstance(spec, (str, bytes)):
        shape = tuple(_as_int(d, f"dimension of parameter {name!r}") for d in spec)
    else:
        shape = (_as_int(spec, f"size of parameter {name!r}"),)
    if any(d < 0 for d in shape):
        raise ConfigError(f"parameter {name!r} has a negative size: {shape}")
    return shape


class ParamSlot(NamedTuple):
    """Where one parameter lives in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    numel: int
    offset: int


class Segment(NamedTuple):
    """A piece of one parameter owned by one rank."""

    rank: int
    param_offset: int  # first element of the piece, within the flattened parameter
    shard_offset: int  # where the piece starts inside the rank's shard
    length: int


class RankSlice(NamedTuple):
    """A piece of a parameter that a given rank owns."""

    name: str
    param_offset: int
    shard_offset: int
    length: int


@dataclass(frozen=True)
class PartitionPlan:
    """Immutable ZeRO layout of ``params`` over ``world_size`` ranks.

    Build it with :meth:`build`; direct construction validates the slots.
    """

    world_size: int
    alignment: int
    params: tuple[ParamSlot, ...]
    numel: int = field(init=False)
    padded_numel: int = field(init=False)
    shard_numel: int = field(init=False)
    _index: dict = field(init=False, repr=False, compare=False)
    _offsets: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "alignment"):
            value = _as_int(getattr(self, name), name)
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
            object.__setattr__(self, name, value)
        if not self.params:
            raise ConfigError("a partition plan needs at least one parameter, got an empty list")
        index: dict[str, int] = {}
        slots: list[ParamSlot] = []
        offset = 0
        for i, raw in enumerate(self.params):
            name, shape, numel, start = raw
            if not isinstance(name, str) or not name:
                raise ConfigError(f"parameter names must be non-empty strings, got {name!r}")
            if name in index:
                raise ConfigError(f"duplicate parameter name {name!r}")
            shape = _as_shape(shape, name)
            if start != offset or numel != math.prod(shape):
                raise PartitionError(f"slot {name!r} (offset {start}, numel {numel}) does not follow "
                                     f"the slots before it or its shape {shape}")
            index[name] = i
            slots.append(ParamSlot(name, shape, math.prod(shape), offset))
            offset += math.prod(shape)
        unit = self.world_size * self.alignment
        padded = -(-offset // unit) * unit
        object.__setattr__(self, "params", tuple(slots))
        object.__setattr__(self, "numel", offset)
        object.__setattr__(self, "padded_numel", padded)
        object.__setattr__(self, "shard_numel", padded // self.world_size)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_offsets", tuple(s.offset for s in self.params))

    @classmethod
    def build(cls, params: Union[Mapping[str, ParamSpec], Iterable[tuple[str, ParamSpec]]],
              world_size: int, *, alignment: int = 1) -> "PartitionPlan":
        """Plan ordered ``(name, shape)`` or ``(name, numel)`` pairs over ``world_size`` ranks."""
        items = list(params.items()) if isinstance(params, Mapping) else list(params)
        slots: list[ParamSlot] = []
        offset = 0
        for item in items:
            try:
                name, spec = item
            except (TypeError, ValueError):
                raise ConfigError(f"expected (name, shape) or (name, numel), got {item!r}") from None
            shape = _as_shape(spec, name)
            numel = math.prod(shape)
            slots.append(ParamSlot(name, shape, numel, offset))
            offset += numel
        return cls(world_size=world_size, alignment=alignment, params=tuple(slots))

    def with_world_size(self, world_size: int) -> "PartitionPlan":
        """The same parameters and alignment laid out over another world size."""
        return PartitionPlan(world_size=world_size, alignment=self.alignment, params=self.params)

    # -- queries ------------------------------------------------------------------
    def _check_rank(self, rank: int) -> int:
        rank = _as_int(rank, "rank")
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank

    def slot(self, name: str) -> ParamSlot:
        """The slot of parameter ``name``."""
        try:
            return self.params[self._index[name]]
        except KeyError:
            raise PartitionError(f"no parameter named {name!r} in the plan") from None

    def owned_range(self, rank: int) -> tuple[int, int]:
        """Half-open flat range ``(start, end)`` of the padded buffer owned by ``rank``."""
        rank = self._check_rank(rank)
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def padding(self, rank: int) -> int:
        """Number of padding elements at the end of ``rank``'s shard."""
        start, end = self.owned_range(rank)
        return end - max(start, min(end, self.numel))

    def segments(self, name: str) -> list[Segment]:
        """The pieces of parameter ``name`` in rank order; they tile the parameter exactly."""
        slot = self.slot(name)
        out: list[Segment] = []
        pos, end = slot.offset, slot.offset + slot.numel
        while pos < end:
            rank = pos // self.shard_numel
            stop = min(end, (rank + 1) * self.shard_numel)
            out.append(Segment(rank, pos - slot.offset, pos - rank * self.shard_numel, stop - pos))
            pos = stop
        return out

    def rank_params(self, rank: int) -> list[RankSlice]:
        """Every piece of every parameter that ``rank`` owns, in buffer order."""
        start, end = self.owned_range(rank)
        out: list[RankSlice] = []
        i = max(0, bisect.bisect_right(self._offsets, start) - 1)
        for slot in self.params[i:]:
            if slot.offset >= end:
                break
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                out.append(RankSlice(slot.name, lo - slot.offset, lo - start, hi - lo))
        return out

    # -- identity and serialisation ----------------------------------------------
    def model_fingerprint(self) -> str:
        """Hash of the parameter names and shapes only (same model, any world size)."""
        return _sha({"v": PLAN_FORMAT_VERSION, "params": [[s.name, list(s.shape)] for s in self.params]})

    def fingerprint(self) -> str:
        """Hash of names, shapes, world size and alignment; equal plans have equal hashes."""
        return _sha({"v": PLAN_FORMAT_VERSION, "params": [[s.name, list(s.shape)] for s in self.params],
                     "world_size": self.world_size, "alignment": self.alignment})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description (inputs, derived sizes and fingerprint)."""
        return {
            "version": PLAN_FORMAT_VERSION,
            "world_size": self.world_size,
            "alignment": self.alignment,
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "shard_numel": self.shard_numel,
            "params": [{"name": s.name, "shape": list(s.shape), "numel": s.numel, "offset": s.offset}
                       for s in self.params],
            "fingerprint": self.fingerprint(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PartitionPlan":
        """Rebuild a plan from :meth:`to_dict` output, refusing inconsistent data."""
        try:
            if data["version"] != PLAN_FORMAT_VERSION:
                raise PartitionError(f"unsupported plan format version {data['version']!r}")
            plan = cls.build([(p["name"], p["shape"]) for p in data["params"]],
                             data["world_size"], alignment=data["alignment"])
        except (KeyError, TypeError) as exc:
            raise PartitionError(f"malformed partition plan dict: missing or bad {exc}") from None
        stored = {k: data[k] for k in ("numel", "padded_numel", "shard_numel", "fingerprint") if k in data}
        derived = plan.to_dict()
        for key, value in stored.items():
            if derived[key] != value:
                raise PartitionError(f"plan dict is inconsistent: {key} is {value!r}, "
                                     f"the parameters give {derived[key]!r}")
        return plan


def _sha(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- numpy helpers ----------------------------------------------------------------
def flatten(arrays: Union[Mapping[str, Any], Sequence[Any]], plan: PartitionPlan,
            dtype: Any = None) -> np.ndarray:
    """Pack arrays (by name, or in plan order) into a new zero-padded flat buffer."""
    if isinstance(arrays, Mapping):
        missing = [s.name for s in plan.params if s.name not in arrays]
        extra = sorted(set(arrays) - {s.name for s in plan.params})
        if missing or extra:
            raise PartitionError(f"arrays do not match the plan: missing {missing}, unexpected {extra}")
        values = [np.asarray(arrays[s.name]) for s in plan.params]
    else:
        values = [np.asarray(a) for a in arrays]
        if len(values) != len(plan.params):
            raise PartitionError(f"expected {len(plan.params)} arrays, got {len(values)}")
    for slot, value in zip(plan.params, values):
        if value.shape != slot.shape:
            raise PartitionError(f"parameter {slot.name!r} has shape {value.shape}, plan says {slot.shape}")
    out_dtype = np.dtype(dtype) if dtype is not None else np.result_type(*values)
    flat = np.zeros(plan.padded_numel, dtype=out_dtype)
    for slot, value in zip(plan.params, values):
        flat[slot.offset:slot.offset + slot.numel] = value.reshape(-1)
    return flat


def _check_flat(flat: Any, plan: PartitionPlan) -> np.ndarray:
    flat = np.asarray(flat)
    if flat.shape != (plan.padded_numel,):
        raise PartitionError(f"flat buffer must have shape ({plan.padded_numel},), got {flat.shape}")
    return flat


def unflatten(flat: Any, plan: PartitionPlan) -> dict[str, np.ndarray]:
    """Views of each parameter, reshaped, inside the padded flat buffer."""
    flat = _check_flat(flat, plan)
    return {s.name: flat[s.offset:s.offset + s.numel].reshape(s.shape) for s in plan.params}


def shard_of(flat: Any, plan: PartitionPlan, rank: int) -> np.ndarray:
    """A view of ``rank``'s shard of the padded flat buffer."""
    flat = _check_flat(flat, plan)
    start, end = plan.owned_range(rank)
    return flat[start:end]


def unshard(shards: Sequence[Any], plan: PartitionPlan) -> np.ndarray:
    """Concatenate every rank's shard back into the padded flat buffer."""
    if len(shards) != plan.world_size:
        raise PartitionError(f"expected {plan.world_size} shards (one per rank), got {len(shards)}")
    arrays = [np.asarray(s) for s in shards]
    for rank, shard in enumerate(arrays):
        if shard.shape != (plan.shard_numel,):
            raise PartitionError(f"shard of rank {rank} has shape {shard.shape}, "
                                 f"plan says ({plan.shard_numel},)")
    return np.concatenate(arrays)


def reshard(shards: Sequence[Any], old_plan: PartitionPlan, new_world_size: int) -> list[np.ndarray]:
    """Re-split shards saved under ``old_plan`` for ``new_world_size`` ranks, bit-exactly.

    Real elements are copied unchanged; padding of the new layout is zero.
    """
    new_plan = old_plan.with_world_size(new_world_size)
    flat = unshard(shards, old_plan)
    out = np.zeros(new_plan.padded_numel, dtype=flat.dtype)
    out[:old_plan.numel] = flat[:old_plan.numel]
    return [out[r * new_plan.shard_numel:(r + 1) * new_plan.shard_numel].copy()
            for r in range(new_world_size)]
