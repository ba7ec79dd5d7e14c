"""Whole tables out of a sharded collection and back in: the framework-neutral view of its state.

:func:`full_tables` assembles every table from every rank's shards over ``collection.comm``
(collective); :func:`load_full_tables` copies each rank's shards out of whole tables (local).
A table held whole by several ranks (replicated, e.g. data parallel: every rank's shard
covers the whole table) is taken once, from its first shard in plan order.
Both need only the collection's ``comm``, ``plan``, ``tables``, ``pending``, ``shard_names()``,
``shard(name)`` and ``shard_of(name)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Optional

import torch

from ....core.embedding_plan import TableShard
from ....core.errors import ConfigError, ShapeMismatchError

if TYPE_CHECKING:  # pragma: no cover
    from .collection import ShardedEmbeddingBagCollection

__all__ = ["full_tables", "load_full_tables", "check_full_tables"]


class _Piece(NamedTuple):
    """One block of a table that one rank sends: shard ``index`` of ``table``."""

    table: str
    index: int
    shard: TableShard

    @property
    def numel(self) -> int:
        return self.shard.rows * self.shard.cols


def _pieces(collection: "ShardedEmbeddingBagCollection") -> list[_Piece]:
    """Every table's distinct blocks in plan order (a block held by several ranks: its first shard only).

    The same on every rank (it reads only the plan, which the ranks agreed on when building)."""
    pieces = []
    for p in collection.plan.placements:
        seen: set[tuple[int, int, int, int]] = set()
        covered = 0
        for i, s in enumerate(p.shards):
            region = (s.row_start, s.row_end, s.col_start, s.col_end)
            if region in seen:
                continue
            seen.add(region)
            covered += s.rows * s.cols
            pieces.append(_Piece(p.table.name, i, s))
        if covered != p.table.elements:
            raise ConfigError(f"table {p.table.name!r}: its distinct shards hold {covered} of its "
                              f"{p.table.elements} elements ({p.table.num_embeddings} x {p.table.embedding_dim}); "
                              "the plan does not tile it")
    return pieces


def _key(piece: _Piece) -> str:
    return f"{piece.table}__shard{piece.index}"


def _agreed_dtype_device(collection: "ShardedEmbeddingBagCollection") -> tuple[torch.dtype, torch.device]:
    """Collective: the shards' dtype (the same on every rank, else a ConfigError on every rank) and the
    device this rank exchanges them on (its shards', or the holders' kind of device where it holds none)."""
    names = collection.shard_names()
    mine = None
    if names:
        first = collection.shard(names[0])
        mine = (str(first.dtype).replace("torch.", ""), first.device.type)
    seen = collection.comm.allgather_object(mine)
    held = [(r, m) for r, m in enumerate(seen) if m is not None]
    if not held:
        raise ConfigError("no rank holds a shard of any table")
    dtypes = sorted({m[0] for _, m in held})
    if len(dtypes) > 1:
        raise ConfigError(f"the ranks' shards have different dtypes: "
                          f"{', '.join(f'rank {r} {m[0]}' for r, m in held)}; cast them alike first")
    dtype = getattr(torch, dtypes[0])
    if names:
        return dtype, collection.shard(names[0]).device
    kind = held[0][1][1]
    if kind == "cuda":
        return dtype, torch.device("cuda", torch.cuda.current_device())
    return dtype, torch.device(kind)


def full_tables(collection: "ShardedEmbeddingBagCollection", dst: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Collective (every rank calls it): every table whole, ``{table: [num_embeddings, embedding_dim]}``
    in the collection's table order, assembled from every rank's shards.

    ``dst=None``: on every rank (one allgather). ``dst=r``: on rank ``r`` only, ``{}`` elsewhere (the
    other ranks send it their blocks). A replicated table is taken once, from its first shard. The
    tables are new tensors (not views of the shards) in the shards' dtype, on the shards' device.
    """
    comm = collection.comm
    if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < comm.size):
        raise ConfigError(f"dst must be a rank in 0 .. {comm.size - 1} or None, got {dst!r}")
    pieces = _pieces(collection)
    dtype, device = _agreed_dtype_device(collection)
    by_rank = [[p for p in pieces if p.shard.rank == r] for r in range(comm.size)]
    sizes = [sum(p.numel for p in ps) for ps in by_rank]
    flat = (torch.cat([collection.shard(_key(p)).detach().reshape(-1).to(dtype) for p in by_rank[comm.rank]])
            if by_rank[comm.rank] else torch.zeros(0, dtype=dtype, device=device))
    if dst is None:
        gathered = comm.allgather(flat)
        blocks = list(torch.split(gathered, sizes))
    elif comm.rank != dst:
        if sizes[comm.rank]:
            comm.send(flat, dst)
        return {}
    else:
        blocks = []
        for r in range(comm.size):
            if r == comm.rank or not sizes[r]:
                blocks.append(flat if r == comm.rank else flat.new_zeros(0))
                continue
            blocks.append(comm.recv(torch.empty(sizes[r], dtype=dtype, device=device), r))
    out = {name: torch.empty(t.num_embeddings, t.embedding_dim, dtype=dtype, device=device)
           for name, t in collection.tables.items()}
    for ps, block in zip(by_rank, blocks):
        for p, values in zip(ps, torch.split(block, [q.numel for q in ps])):
            s = p.shard
            out[p.table][s.row_start:s.row_end, s.col_start:s.col_end] = values.view(s.rows, s.cols)
    return out


def check_full_tables(collection: "ShardedEmbeddingBagCollection", tables: Mapping[str, Any],
                      label: Callable[[str], str] = repr) -> dict[str, torch.Tensor]:
    """``tables`` as tensors after checking that they are exactly the collection's, each of its shape:
    :class:`ConfigError` naming missing or extra ones, :class:`ShapeMismatchError` naming a mis-shaped
    one (``label(name)`` names a table in the messages)."""
    missing = [n for n in collection.tables if n not in tables]
    extra = [n for n in tables if n not in collection.tables]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(label(n) for n in missing)}")
        if extra:
            parts.append(f"not tables of this collection: {', '.join(label(str(n)) for n in extra)}")
        raise ConfigError(f"the tables do not match the collection's {list(collection.tables)}: "
                          + "; ".join(parts))
    out = {}
    for name, t in collection.tables.items():
        value = torch.as_tensor(tables[name])
        if tuple(value.shape) != (t.num_embeddings, t.embedding_dim):
            raise ShapeMismatchError(f"{label(name)} has shape {tuple(value.shape)}, but table {name!r} is "
                                     f"{(t.num_embeddings, t.embedding_dim)} (num_embeddings, embedding_dim)")
        out[name] = value
    return out


def load_full_tables(collection: "ShardedEmbeddingBagCollection", tables: Mapping[str, Any]) -> None:
    """Copy each rank's shards out of whole tables ``{table: [num_embeddings, embedding_dim]}`` (tensors or
    arrays, any device): every rank calls it with the same tables; no communication.

    Every table of the collection must be there with its shape, and no other (checked before anything is
    copied). Pending row gradients are dropped (they were for the old values); a sparse optimizer's state
    (Adagrad accumulators) is kept: build a new one for a fresh start.
    """
    checked = check_full_tables(collection, tables)
    with torch.no_grad():
        for name in collection.shard_names():
            table, s = collection.shard_of(name)
            collection.shard(name).copy_(checked[table.name][s.row_start:s.row_end, s.col_start:s.col_end])
    collection.pending.clear()
