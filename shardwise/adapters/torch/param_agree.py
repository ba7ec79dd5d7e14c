"""Checking that every rank holds the same parameters, and agreeing on rank 0's order."""

from __future__ import annotations

from typing import Sequence

import torch

from shardwise.core.buckets import plan_fingerprint
from shardwise.core.comm import Communicator
from shardwise.core.errors import ConfigError

__all__ = ["Entry", "ModelMismatchError", "agree_parameters", "dtype_name"]

Entry = tuple[str, tuple[int, ...], str]


class ModelMismatchError(ConfigError):
    """Ranks hold different models (parameter names, shapes or dtypes differ)."""


def dtype_name(t: torch.Tensor) -> str:
    """``float32`` for ``torch.float32``."""
    return str(t.dtype).replace("torch.", "")


def _describe(mine: Sequence[Entry], ref: Sequence[Entry]) -> str:
    ref_by_name, mine_by_name = {e[0]: e for e in ref}, {e[0]: e for e in mine}
    missing = [n for n in ref_by_name if n not in mine_by_name]
    extra = [n for n in mine_by_name if n not in ref_by_name]
    if missing or extra:
        return f"{len(mine)} tensors vs {len(ref)} on rank 0; missing {missing[:3]}, extra {extra[:3]}"
    for name, entry in mine_by_name.items():
        if entry != ref_by_name[name]:
            _, shape, dtype = ref_by_name[name]
            return f"'{name}' is {entry[1]} {entry[2]} here but {shape} {dtype} on rank 0"
    return "duplicate names: the order cannot be matched to rank 0's"


def agree_parameters(comm: Communicator, entries: Sequence[Entry], what: str = "model") -> list[int]:
    """Check that every rank has the same (name, shape, dtype) list; return rank 0's order as indices.

    Collective. Raises :class:`ModelMismatchError` naming the differing ranks on every rank.
    """
    identity = list(range(len(entries)))
    if comm.size == 1:
        return identity
    fingerprint = plan_fingerprint([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])
    if len(set(comm.allgather_object(fingerprint))) == 1:
        return identity
    ref = comm.broadcast_object(list(entries) if comm.rank == 0 else None, 0)
    names = [e[0] for e in entries]
    same = len(set(names)) == len(names) and sorted(entries) == sorted(ref)
    problems = comm.allgather_object(None if same else _describe(entries, ref))
    bad = {r: p for r, p in enumerate(problems) if p is not None}
    if bad:
        detail = "; ".join(f"rank {r}: {p}" for r, p in bad.items())
        raise ModelMismatchError(f"the {what} differs between ranks: rank(s) {sorted(bad)} do not match "
                                 f"rank 0 ({detail}); every rank must build the same model")
    position = {name: i for i, name in enumerate(names)}
    return [position[e[0]] for e in ref]
