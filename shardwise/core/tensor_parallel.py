"""Megatron-style tensor-parallel split rules as pure maths, with numpy references.

Weights use the torch ``Linear`` layout ``[out_features, in_features]`` (``y = x @ W.T``).

* **column**-parallel: rank ``r`` owns a contiguous block of output rows (and the
  same block of the bias); its output is a slice of ``y`` along the last dim.
* **row**-parallel: rank ``r`` owns a block of input columns and consumes the
  matching slice of ``x``; partial outputs are summed (allreduce), bias added once.
* **vocab_embedding**: the ``[vocab, hidden]`` table is split by rows. The vocab
  is first padded to a multiple of ``tp_size`` (times ``multiple``); padded rows
  are zero-initialised and never looked up, and a vocab-parallel output layer
  must mask their logits (e.g. to ``-inf``) so they never take probability.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

import numpy as np

from .errors import ConfigError

__all__ = [
    "TensorParallelError", "Collective", "LayerCommunication", "COMMUNICATION", "collectives_for",
    "column_parallel_shard", "row_parallel_shard", "padded_vocab_size", "vocab_parallel_range",
    "split_weight", "merge_weight", "SPLIT_KINDS",
]

SPLIT_KINDS = ("column", "row", "vocab_embedding")


class TensorParallelError(ConfigError):
    """A shape, tensor-parallel size or rank that does not admit the requested split."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective over the tensor-parallel group: ``op`` with ``reduce`` applied to ``what``."""

    op: str
    reduce: Optional[str]
    what: str


@dataclasses.dataclass(frozen=True)
class LayerCommunication:
    """Collectives a tensor-parallel layer issues in forward and in backward (in order)."""

    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    note: str = ""


_SUM = "sum"
COMMUNICATION: Mapping[str, LayerCommunication] = MappingProxyType({
    "column": LayerCommunication(
        (), (Collective("allreduce", _SUM, "input gradient"),),
        "Megatron 'f': identity forward, allreduce of the input gradient in backward"),
    "column_gather": LayerCommunication(
        (Collective("allgather", None, "output shards along the last dim"),),
        (Collective("allreduce", _SUM, "input gradient"),),
        "column with gather_output=True; backward splits the output gradient locally"),
    "row": LayerCommunication(
        (Collective("allreduce", _SUM, "partial outputs"),), (),
        "Megatron 'g': allreduce forward, identity backward (input already parallel)"),
    "vocab_embedding": LayerCommunication(
        (Collective("allreduce", _SUM, "masked embedding lookups"),), (),
        "out-of-shard ids look up zeros; the weight gradient stays on its shard"),
    "parallel_cross_entropy": LayerCommunication(
        (Collective("allreduce", "max", "per-token max logit"),
         Collective("allreduce", _SUM, "target logit (zero off its shard)"),
         Collective("allreduce", _SUM, "sum of exp(logit - max)")), (),
        "backward is local: softmax shard minus one-hot on the owning shard"),
})


def collectives_for(layer_kind: str, gather_output: bool = False) -> LayerCommunication:
    """Forward and backward collectives of ``layer_kind`` (see :data:`COMMUNICATION`)."""
    key = "column_gather" if layer_kind == "column" and gather_output else layer_kind
    if gather_output and layer_kind != "column":
        raise TensorParallelError(f"gather_output only applies to 'column' layers, not {layer_kind!r}")
    try:
        return COMMUNICATION[key]
    except KeyError:
        names = ", ".join(sorted(k for k in COMMUNICATION if k != "column_gather"))
        raise TensorParallelError(f"unknown layer kind {layer_kind!r}; expected one of: {names}") from None


def _check_group(tp_size: int, tp_rank: Optional[int] = None) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise TensorParallelError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    if tp_rank is not None and (isinstance(tp_rank, bool) or not isinstance(tp_rank, int)
                                or not 0 <= tp_rank < tp_size):
        raise TensorParallelError(f"tp_rank {tp_rank!r} is not in [0, {tp_size})")


def _check_dims(out_features: int, in_features: int) -> None:
    for label, value in (("out_features", out_features), ("in_features", in_features)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TensorParallelError(f"{label} must be an integer >= 1, got {value!r}")


def _block(total: int, tp_size: int, tp_rank: int, what: str) -> slice:
    if total % tp_size:
        raise TensorParallelError(f"{what} is not divisible by tp_size {tp_size}")
    size = total // tp_size
    return slice(tp_rank * size, (tp_rank + 1) * size)


def column_parallel_shard(out_features: int, in_features: int, tp_size: int,
                          tp_rank: int) -> tuple[slice, slice]:
    """Index of rank ``tp_rank``'s rows of a ``[out, in]`` weight (``weight[idx]``; bias: ``idx[0]``)."""
    _check_dims(out_features, in_features)
    _check_group(tp_size, tp_rank)
    rows = _block(out_features, tp_size, tp_rank,
                  f"column-parallel weight [{out_features}, {in_features}]: out_features {out_features}")
    return rows, slice(0, in_features)


def row_parallel_shard(out_features: int, in_features: int, tp_size: int,
                       tp_rank: int) -> tuple[slice, slice]:
    """Index of rank ``tp_rank``'s input columns of a ``[out, in]`` weight (``weight[idx]``)."""
    _check_dims(out_features, in_features)
    _check_group(tp_size, tp_rank)
    cols = _block(in_features, tp_size, tp_rank,
                  f"row-parallel weight [{out_features}, {in_features}]: in_features {in_features}")
    return slice(0, out_features), cols


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple * tp_size`` (Megatron's padding)."""
    _check_group(tp_size)
    for label, value in (("vocab_size", vocab_size), ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TensorParallelError(f"{label} must be an integer >= 1, got {value!r}")
    step = multiple * tp_size
    return -(-vocab_size // step) * step


def vocab_parallel_range(vocab_size: int, tp_size: int, tp_rank: int,
                         multiple: int = 1) -> tuple[int, int]:
    """Half-open ``(start, end)`` of token ids owned by ``tp_rank`` in the padded vocab.

    The last ranks' ranges may extend past ``vocab_size`` into padding ids.
    """
    _check_group(tp_size, tp_rank)
    per_rank = padded_vocab_size(vocab_size, tp_size, multiple) // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def _split_kind(kind: str) -> str:
    if kind not in SPLIT_KINDS:
        raise TensorParallelError(f"unknown split kind {kind!r}; expected one of {SPLIT_KINDS}")
    return kind


def split_weight(weight: np.ndarray, kind: str, tp_size: int, multiple: int = 1) -> list[np.ndarray]:
    """Split a full weight (or a column-parallel bias) into ``tp_size`` shards.

    ``column`` and ``vocab_embedding`` split axis 0; ``row`` splits axis 1 of a 2-D
    weight. ``vocab_embedding`` first pads the table with zero rows (see
    :func:`padded_vocab_size`); pass ``vocab_size`` to :func:`merge_weight` to undo it.
    """
    _split_kind(kind)
    _check_group(tp_size)
    w = np.asarray(weight)
    if kind == "row" and w.ndim != 2:
        raise TensorParallelError(f"row-parallel split needs a 2-D [out, in] weight, got shape {w.shape}")
    if w.ndim not in (1, 2) or w.shape[0] == 0:
        raise TensorParallelError(f"{kind} split needs a non-empty 1-D or 2-D array, got shape {w.shape}")
    if kind == "vocab_embedding":
        padded = padded_vocab_size(w.shape[0], tp_size, multiple)
        w = np.concatenate([w, np.zeros((padded - w.shape[0],) + w.shape[1:], dtype=w.dtype)])
        axis = 0
    else:
        axis = 0 if kind == "column" else 1
        if w.shape[axis] % tp_size:
            raise TensorParallelError(
                f"{kind}-parallel split of shape {tuple(w.shape)}: dim {axis} ({w.shape[axis]}) "
                f"is not divisible by tp_size {tp_size}")
    return [s.copy() for s in np.split(w, tp_size, axis=axis)]


def merge_weight(shards: Sequence[np.ndarray], kind: str, vocab_size: Optional[int] = None) -> np.ndarray:
    """Inverse of :func:`split_weight`; ``vocab_size`` trims vocab padding rows."""
    _split_kind(kind)
    if len(shards) == 0:
        raise TensorParallelError("merge_weight needs at least one shard")
    arrays = [np.asarray(s) for s in shards]
    axis = 1 if kind == "row" else 0
    shapes = {a.shape[:axis] + a.shape[axis + 1:] for a in arrays if a.ndim > axis}
    if len(shapes) != 1 or any(a.ndim != arrays[0].ndim or a.ndim <= axis for a in arrays):
        raise TensorParallelError(
            f"{kind} shards do not fit together: shapes {[a.shape for a in arrays]}")
    full = np.concatenate(arrays, axis=axis)
    if vocab_size is not None:
        if kind != "vocab_embedding":
            raise TensorParallelError("vocab_size only applies to 'vocab_embedding' merges")
        if not 0 < vocab_size <= full.shape[0]:
            raise TensorParallelError(f"vocab_size {vocab_size} does not fit {full.shape[0]} merged rows")
        full = full[:vocab_size]
    return full
