"""Embedding-bag tables split over ranks, looked up with two all-to-alls (TorchRec's sharded EBC).

Each rank feeds its own samples' ids. Forward: every rank sends each table shard's owner the ids
of its samples that fall into the shard (one all-to-all, with the bag lengths and a status word
so that bad input fails on every rank at once), the owners pool their rows per bag, and a second
all-to-all brings the pooled rows back to the samples' ranks, which add up the row blocks of a
row-wise table and put the column blocks of a column-wise one side by side. Backward mirrors
it: the pooled rows' gradients go to the owners (a third all-to-all), which turn them into row
gradients of the ids they served and keep them for :class:`~.sparse_optim.SparseOptimizer`.
Table gradients are averaged over the ranks, as data parallelism averages the dense ones.
A ``data_parallel`` table is on every rank: each rank looks up its own samples locally, and its
dense gradient is all-reduced at the optimizer step.

A rank keeps the shards it holds of one width in one buffer (TorchRec's fused tables), so one
``embedding_bag`` call pools every bag of every shard and source, and the backward gathers every
row gradient of a width at once; :meth:`ShardedEmbeddingBagCollection.shard` is a view of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ....core.comm import Communicator
from ....core.embedding_lookup import (BAD_BATCH, BAD_ID, OK, FeatureIds, Source,
                                       check_sources, feature_ids, pack_ids, parse_ids, split_weights)
from ....core.embedding_plan import EmbeddingPlan, LookupSlot, ShardingType, TableConfig, TableShard
from ....core.errors import ConfigError, ShapeMismatchError
from ..compiling import not_traced
from .jagged import KeyedJaggedTensor
from .planned import planned_tables
from .table_init import BLOCK_ROWS, init_rows
from .torchrec_interop import as_kjt, as_table_configs

__all__ = ["ShardedEmbeddingBagCollection"]

_INIT_ROWS = 16 * BLOCK_ROWS  # rows drawn at a time when the tables are built


@dataclass
class _Group:
    """The shards of one width this rank holds, stacked in one buffer (registered as ``buffer``)."""

    cols: int
    buffer: str
    rows: int = 0
    bases: dict[str, int] = field(default_factory=dict)
    """Shard key -> its first row in the buffer."""


@dataclass
class _Kept:
    """A lookup's bag gradients, kept for the optimizer step."""

    lookup: "_Lookup"
    bag_grads: torch.Tensor

    def add_to(self, buffer: torch.Tensor, factor: float, chunk: int = 4096) -> None:
        """Add every id's row gradient times ``factor`` to its row of ``buffer``, a few thousand ids at a
        time: each block of expanded rows is added while it is still in cache."""
        dev = self.bag_grads.device
        lengths = self.lookup.lengths.to(dev)
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths)
        ids, weights = self.lookup.ids.to(dev), self.lookup.weights
        scaled = self.bag_grads * factor
        for start in range(0, ids.numel(), chunk):
            rows = scaled.index_select(0, bag[start:start + chunk])
            if weights is not None:
                rows.mul_(weights[start:start + chunk].to(dev).unsqueeze(1))
            buffer.index_add_(0, ids[start:start + chunk], rows)

    def rows(self, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer row of every id and its gradient (its bag's times ``factor``, times its weight)."""
        dev = self.bag_grads.device
        lengths = self.lookup.lengths.to(dev)
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths)
        rows = (self.bag_grads * factor).index_select(0, bag)
        if self.lookup.weights is not None:
            rows.mul_(self.lookup.weights.to(dev).unsqueeze(1))
        return self.lookup.ids.to(dev), rows


@dataclass
class _Lookup:
    """What the owner's pooling of one width keeps for its backward."""

    ids: torch.Tensor
    """Buffer rows of every id served, in (source, slot, bag) order."""
    lengths: torch.Tensor
    """Ids per bag, same order."""
    weights: Optional[torch.Tensor]
    bags: list[int]
    """Bags per source."""


class ShardedEmbeddingBagCollection(nn.Module):
    """Sum- or mean-pooled embedding bags over tables split by an :class:`EmbeddingPlan`.

    ``forward(kjt)`` takes this rank's batch as a :class:`KeyedJaggedTensor` (shardwise's or
    TorchRec's) holding every feature of the tables and returns ``{feature: [batch, embedding_dim]}``.
    A feature no table has is refused on every rank, unless ``ignore_unknown_features`` (then it is
    dropped). Collective: every rank calls it (and backward) in the same order, with batches of any
    size. ``tables`` are :class:`TableConfig` or TorchRec ``EmbeddingBagConfig`` objects. The shards
    are buffers (``model.parameters()`` stays the dense part for a data-parallel optimizer); their
    gradients are kept for a :class:`~.sparse_optim.SparseOptimizer`. Initial values are
    :func:`~.table_init.init_rows` of ``seed``: those of the whole tables built in one process.
    ``state_dict()`` holds this rank's shards by :meth:`shard_names`; :meth:`full_tables` gathers whole tables.
    """

    def __init__(self, tables: Sequence[Any], plan: Optional[EmbeddingPlan] = None, *,
                 comm: Optional[Communicator] = None, seed: int = 0, optimizer: str = "sgd",
                 global_batch: int = 1024, ignore_unknown_features: bool = False) -> None:
        super().__init__()
        comm, tables, plan = planned_tables(tables, plan, comm, convert=as_table_configs, optimizer=optimizer,
                                            global_batch=global_batch)
        self.comm = comm
        self.ignore_unknown_features = bool(ignore_unknown_features)
        self.plan, self.tables = plan, {t.name: t for t in tables}
        self.features = tuple(f for t in tables for f in t.feature_names)
        self._feature_table = {f: t for t in tables for f in t.feature_names}
        rank = comm.rank
        self.slots: list[LookupSlot] = []  # looked up through the all-to-alls
        self._local: list[LookupSlot] = []  # data_parallel: this rank's own samples, here
        held: list[tuple[str, TableConfig, TableShard]] = []
        for p in plan.placements:
            replicated = p.sharding is ShardingType.DATA_PARALLEL
            for i, shard in enumerate(p.shards):
                key = f"{p.table.name}__shard{i}"
                if shard.rank == rank:
                    held.append((key, p.table, shard))
                if replicated and shard.rank != rank:
                    continue
                for f in p.table.feature_names:
                    (self._local if replicated else self.slots).append(LookupSlot(f, p.table, shard, key))
        order = {f: i for i, f in enumerate(self.features)}
        self.slots.sort(key=lambda s: (s.shard.rank, s.shard.cols, order[s.feature], s.key))
        self._local.sort(key=lambda s: (s.shard.cols, order[s.feature], s.key))
        self._to = [[s for s in self.slots if s.shard.rank == d] for d in range(comm.size)]
        self._cols_to = [sum(s.shard.cols for s in slots) for slots in self._to]  # pooled width per owner
        self._replicated_keys = [key for key, t, _ in held if plan.placement(t.name).sharding is
                                 ShardingType.DATA_PARALLEL]
        # one buffer per width, the shards in plan order
        self._groups: dict[int, _Group] = {}
        self._where: dict[str, tuple[_Group, TableShard]] = {}
        for key, _, shard in held:
            g = self._groups.setdefault(shard.cols, _Group(shard.cols, f"_fused_{shard.cols}"))
            g.bases[key] = g.rows
            g.rows += shard.rows
            self._where[key] = (g, shard)
        self._shard_names = [key for key, _, _ in held]
        for g in self._groups.values():
            self.register_buffer(g.buffer, torch.empty(g.rows, g.cols), persistent=False)
        for key, table, shard in held:  # block by block: no shard-sized temporary beside the buffer
            values = self.shard(key)
            for start in range(shard.row_start, shard.row_end, _INIT_ROWS):
                stop = min(start + _INIT_ROWS, shard.row_end)
                values[start - shard.row_start:stop - shard.row_start].copy_(
                    init_rows(table, seed, (start, stop), (shard.col_start, shard.col_end)))
        # where each feature's pooled block sits in the forward's [batch, sum of dims] output
        self._dims = [self._feature_table[f].embedding_dim for f in self.features]
        starts = np.cumsum([0] + self._dims)
        self._col = {f: int(starts[i]) for i, f in enumerate(self.features)}
        self._width = int(starts[-1])
        self._mean = [f for f in self.features if self._feature_table[f].pooling == "mean"]
        self._partial_rows = any(not s.full_rows for s in self.slots)
        # where every block received is a whole-rows block of one width C at a multiple of C (table-wise,
        # or column-wise with equal blocks), the blocks map onto the output's C-wide columns in one copy
        self._blocks: Optional[tuple[int, torch.Tensor]] = None
        widths = {sl.shard.cols for sl in self.slots}
        if self.slots and len(widths) == 1 and not self._partial_rows:
            c = widths.pop()
            starts = [self._col[sl.feature] + sl.shard.col_start for slots in self._to for sl in slots]
            if self._width % c == 0 and all(c0 % c == 0 for c0 in starts):
                self._blocks = (c, torch.tensor([c0 // c for c0 in starts], dtype=torch.long))
        self._anchor = torch.zeros((), requires_grad=True)
        #: buffer -> the lookups' bag gradients kept for the optimizer step (expanded to rows there)
        self.pending: dict[str, list[_Kept]] = {}
        #: the same for data_parallel shards, all-reduced at the optimizer step
        self._pending_replicated: dict[str, list[_Kept]] = {}

    @property
    def device(self) -> torch.device:
        """Where this rank's shards live (move them with ``.to(device)``): pooled rows and their
        gradients are computed and exchanged there; ids are exchanged and parsed on the host."""
        return next((b.device for b in self.buffers()), torch.device("cpu"))

    def shard_names(self) -> list[str]:
        """Names of the shards this rank holds (``<table>__shard<index>``), in plan order."""
        return list(self._shard_names)

    def shard(self, name: str) -> torch.Tensor:
        """The values of one shard this rank holds (``shard_names()``), in place: writing them changes the table."""
        if name not in self._where:
            raise ConfigError(f"rank {self.comm.rank} holds no shard {name!r}; it holds {self._shard_names}")
        g, shard = self._where[name]
        base = g.bases[name]
        return getattr(self, g.buffer)[base:base + shard.rows]

    def __getattr__(self, name: str) -> Any:
        where = self.__dict__.get("_where")
        if where is not None and name in where:  # a shard by name, as when each shard was a buffer of its own
            return self.shard(name)
        return super().__getattr__(name)

    def shard_of(self, name: str) -> tuple[TableConfig, TableShard]:
        """The table and shard a shard name stands for."""
        table, index = name.rsplit("__shard", 1)
        return self.tables[table], self.plan.placement(table).shards[int(index)]

    def full_tables(self, dst: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Every table whole (collective): on every rank, or on rank ``dst`` only (``{}`` elsewhere)."""
        from .tables_io import full_tables
        return full_tables(self, dst=dst)

    def load_full_tables(self, tables: Mapping[str, torch.Tensor]) -> None:
        """Set every table from whole values (each rank copies its shards; shapes are checked)."""
        from .tables_io import load_full_tables
        load_full_tables(self, tables)

    # -- state_dict: this rank's shards by name ------------------------------------------------
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self._shard_names:
            value = self.shard(name)
            destination[prefix + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        with torch.no_grad():
            for name in self._shard_names:
                key = prefix + name
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value, target = state_dict[key], self.shard(name)
                if tuple(value.shape) != tuple(target.shape):
                    error_msgs.append(f"size mismatch for {key}: copying a shard of shape {tuple(value.shape)}, "
                                      f"this rank's is {tuple(target.shape)}")
                    continue
                target.copy_(value)
        mine = {prefix + name for name in self._shard_names}  # nn.Module counts them unexpected: not buffers
        unexpected_keys[:] = [k for k in unexpected_keys if k not in mine]
        self.clear_grads()

    # -- forward: ids to the owners, pooled rows back --------------------------------------------
    def _split_ids(self, kjt: KeyedJaggedTensor) -> tuple[int, int, str, dict[str, FeatureIds]]:
        """Per feature its ids, bag lengths and weights on the host; a status word and its message.

        Ids go to the host here: their packets are cut and parsed by value (sizes read as
        Python ints), which on a GPU would cost a synchronisation per read.
        """
        batch = kjt.batch_size
        unknown = [k for k in kjt.keys if k not in self._feature_table]
        missing = [f for f in self.features if f not in kjt.keys]
        problems = []
        if unknown and not self.ignore_unknown_features:
            problems.append(f"features {unknown} are in no table of this collection (its features: "
                            f"{list(self.features)}); pass ignore_unknown_features=True to drop such features")
        if missing:
            problems.append(f"features {missing} are missing from the batch")
        if problems:
            return batch, BAD_BATCH, "; ".join(problems), {}
        values = kjt.values.detach().cpu().numpy()
        lengths = kjt.lengths.detach().cpu().numpy()
        weights = None if kjt.weights is None else kjt.weights.detach().cpu().float().numpy()
        ends = np.cumsum(lengths.reshape(len(kjt.keys), batch).sum(axis=1))
        per: dict[str, FeatureIds] = {}
        for k, f in enumerate(kjt.keys):
            if f not in self._feature_table:
                continue
            table = self._feature_table[f]
            start, stop = (int(ends[k - 1]) if k else 0), int(ends[k])
            v = values[start:stop]
            if v.size and (int(v.min()) < 0 or int(v.max()) >= table.num_embeddings):
                bad = v[(v < 0) | (v >= table.num_embeddings)]
                return batch, BAD_ID, (f"feature {f!r}: id {int(bad[0])} is outside table "
                                       f"{table.name!r} (0 .. {table.num_embeddings - 1})"), {}
            if table.weighted and weights is None:
                return batch, BAD_BATCH, (f"feature {f!r}: table {table.name!r} is weighted, but the batch "
                                          "carries no weights"), {}
            use = weights is not None and (table.weighted or (table.weighted is None and table.pooling == "sum"))
            per[f] = feature_ids(v, lengths[k * batch:(k + 1) * batch], weights[start:stop] if use else None)
        return batch, OK, "", per

    def _exchange_ids(self, kjt: KeyedJaggedTensor) -> tuple[int, dict[str, FeatureIds], list[Source],
                                                              Optional[list[list[np.ndarray]]]]:
        """The id exchange (:mod:`shardwise.core.embedding_lookup`): this rank's batch and features, per
        source what it sent for this rank's slots, and per source and slot the ids' weights (or None)."""
        batch, status, message, per = self._split_ids(kjt)
        packets, weights = pack_ids(self._to, batch, status, per)
        got = self.comm.alltoall(np.concatenate(packets), [p.size for p in packets])
        parsed = parse_ids(np.asarray(got), self.comm.size, self._to[self.comm.rank])
        check_sources(parsed, message)
        got_weights = None
        if any(s.has_weights for s in parsed):
            got_w = self.comm.alltoall(np.concatenate(weights), [w.size for w in weights])
            got_weights = split_weights(np.asarray(got_w), parsed)
        return batch, per, parsed, got_weights

    def _group_slots(self, slots: Sequence[LookupSlot]) -> list[tuple[_Group, int, int]]:
        """``slots`` (sorted by width) cut into runs of one width: (group, first, stop)."""
        runs, start = [], 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i].shard.cols != slots[start].shard.cols:
                runs.append((self._groups[slots[start].shard.cols], start, i))
                start = i
        return runs

    def _pool(self, sources: list[Source], weights: Optional[list[list[np.ndarray]]]
              ) -> tuple[torch.Tensor, list[int], dict[str, _Lookup]]:
        """This rank's pooled row blocks of every slot for every source, flattened source by source, the
        elements per source, and what the backward needs."""
        mine = self._to[self.comm.rank]
        per_source: list[list[torch.Tensor]] = [[] for _ in sources]
        saved: dict[str, _Lookup] = {}
        runs = self._group_slots(mine)
        for g, a, b in runs:
            bases = [g.bases[mine[j].key] for j in range(a, b)]
            ids, lengths, counts, ws = [], [], [], []
            for si, s in enumerate(sources):
                for j in range(a, b):
                    ids.append(s.ids[j])
                    lengths.append(s.lengths[j])
                    counts.append(s.ids[j].size)
                    if weights is not None:  # a sender whose batch had no weights sent none: its ids weigh 1
                        ws.append(weights[si][j] if s.has_weights else np.ones(s.ids[j].size, np.float32))
            rows = np.concatenate(ids) + np.repeat(np.tile(np.asarray(bases, np.int64), len(sources)), counts)
            lookup = _Lookup(torch.from_numpy(rows), torch.from_numpy(np.concatenate(lengths)),
                             torch.from_numpy(np.concatenate(ws)) if ws else None,
                             [s.batch * (b - a) for s in sources])
            saved[g.buffer] = lookup
            per = self._bag(g, lookup)
            if len(runs) == 1:  # already source by source
                return per.reshape(-1), [n * g.cols for n in lookup.bags], saved
            for si, part in enumerate(per.split(lookup.bags)):
                per_source[si].append(part.reshape(-1))
        flat = [t for p in per_source for t in p]
        return (torch.cat(flat) if flat else torch.zeros(0, device=self.device),
                [sum(t.numel() for t in p) for p in per_source], saved)

    def _bag(self, g: _Group, lookup: _Lookup) -> torch.Tensor:
        weight = getattr(self, g.buffer)
        dev = weight.device
        offsets = torch.cumsum(lookup.lengths, 0) - lookup.lengths
        return F.embedding_bag(lookup.ids.to(dev), weight, offsets.to(dev), mode="sum",
                               per_sample_weights=None if lookup.weights is None else lookup.weights.to(dev))

    def _pool_local(self, batch: int, per: dict[str, FeatureIds]) -> tuple[list[tuple[LookupSlot, torch.Tensor]],
                                                                         dict[str, _Lookup]]:
        """The data_parallel features, pooled here from this rank's own ids."""
        out, saved = [], {}
        for g, a, b in self._group_slots(self._local):
            slots = self._local[a:b]
            feats = [per[s.feature] for s in slots]
            rows = np.concatenate([f.values + g.bases[s.key] for s, f in zip(slots, feats)])
            weighted = any(f.weights is not None for f in feats)
            ws = np.concatenate([f.weights if f.weights is not None else np.ones(f.values.size, np.float32)
                                 for f in feats]) if weighted else None
            lookup = _Lookup(torch.from_numpy(rows), torch.from_numpy(np.concatenate([f.lengths for f in feats])),
                             None if ws is None else torch.from_numpy(ws), [batch * len(slots)])
            saved[g.buffer] = lookup
            for s, block in zip(slots, self._bag(g, lookup).split(batch)):
                out.append((s, block))
        return out, saved

    def _assemble(self, batch: int, per: dict[str, FeatureIds], got: torch.Tensor,
                  local: list[tuple[LookupSlot, torch.Tensor]]) -> torch.Tensor:
        """``[batch, sum of dims]``: every feature's pooled rows, from the blocks received and the local ones."""
        dev = got.device if got.numel() else self.device
        make = torch.zeros if self._partial_rows else torch.empty
        pooled = make(batch, self._width, device=dev)
        pos = 0
        if self._blocks is not None:
            c, index = self._blocks
            pooled.view(batch, -1, c).index_copy_(1, index.to(dev), got.view(-1, batch, c).transpose(0, 1))
        for slots in (self._to if self._blocks is None else ()):
            for slot in slots:
                cols = slot.shard.cols
                c0 = self._col[slot.feature] + slot.shard.col_start
                block = got[pos:pos + batch * cols].view(batch, cols)
                if slot.full_rows:
                    pooled[:, c0:c0 + cols].copy_(block)
                else:
                    pooled[:, c0:c0 + cols].add_(block)
                pos += batch * cols
        for slot, block in local:
            c0 = self._col[slot.feature]
            pooled[:, c0:c0 + slot.shard.cols].copy_(block.to(dev))
        for f in self._mean:
            c0 = self._col[f]
            pooled[:, c0:c0 + self._feature_table[f].embedding_dim] /= _bag_sizes(per[f]).to(dev, pooled.dtype)
        return pooled

    @not_traced  # all-to-alls: a compiled model breaks its graph here and runs this eagerly
    def forward(self, kjt: Any) -> dict[str, torch.Tensor]:
        kjt = as_kjt(kjt)
        if not isinstance(kjt, KeyedJaggedTensor):
            raise ShapeMismatchError(f"expected a KeyedJaggedTensor, got {type(kjt).__name__}")
        pooled = _PooledLookup.apply(self._anchor, self, kjt)
        return dict(zip(self.features, pooled.split(self._dims, dim=1)))

    # -- backward: pooled gradients to the owners, row gradients kept -----------------------------
    def _backward(self, batch: int, per: dict[str, FeatureIds], sources: list[Source], saved: dict[str, _Lookup],
                  local: dict[str, _Lookup], grad: torch.Tensor) -> None:
        if self._mean:
            grad = grad.clone()
            for f in self._mean:
                c0 = self._col[f]
                grad[:, c0:c0 + self._feature_table[f].embedding_dim] /= _bag_sizes(per[f]).to(grad.device,
                                                                                             grad.dtype)
        pieces, splits = [], [batch * cols for cols in self._cols_to]
        if self._blocks is not None:  # every block at once: [blocks, batch, C] in the order sent
            c, index = self._blocks
            send = grad.reshape(batch, -1, c).transpose(0, 1).index_select(0, index.to(grad.device)).reshape(-1)
        else:
            for slots in self._to:
                for s in slots:
                    c0 = self._col[s.feature] + s.shard.col_start
                    pieces.append(grad[:, c0:c0 + s.shard.cols].reshape(-1))
            send = torch.cat(pieces) if pieces else torch.zeros(0, device=grad.device)
        mine_cols = self._cols_to[self.comm.rank]
        got = self.comm.alltoall(send.contiguous(), splits, recv_splits=[s.batch * mine_cols for s in sources])
        mine = self._to[self.comm.rank]
        runs = self._group_slots(mine)
        if len(runs) == 1:
            blocks = {runs[0][0].buffer: got}
        else:  # per source the widths come one after another: gather each width's blocks
            parts: dict[str, list[torch.Tensor]] = {g.buffer: [] for g, _, _ in runs}
            pos = 0
            for s in sources:
                for g, a, b in runs:
                    n = s.batch * (b - a) * g.cols
                    parts[g.buffer].append(got[pos:pos + n])
                    pos += n
            blocks = {k: torch.cat(v) for k, v in parts.items()}
        for g, _, _ in runs:
            self._keep(self.pending, g, saved[g.buffer], blocks[g.buffer].view(-1, g.cols))
        for g, a, b in self._group_slots(self._local):
            bags = torch.cat([grad[:, self._col[s.feature]:self._col[s.feature] + g.cols] for s in self._local[a:b]])
            self._keep(self._pending_replicated, g, local[g.buffer], bags)

    @staticmethod
    def _keep(pending: dict, g: _Group, lookup: _Lookup, bag_grads: torch.Tensor) -> None:
        """Keep the bag gradients of ``lookup`` for the step, which expands them to its ids' rows."""
        if lookup.ids.numel():
            pending.setdefault(g.buffer, []).append(_Kept(lookup, bag_grads))

    # -- what the optimizer steps -----------------------------------------------------------------
    def buffers_by_width(self) -> dict[str, torch.Tensor]:
        """Buffer name -> the buffer holding this rank's shards of one width."""
        return {g.buffer: getattr(self, g.buffer) for g in self._groups.values()}

    def shard_rows(self, name: str) -> tuple[str, int, int]:
        """``(buffer, first row, rows)`` of a shard in :meth:`buffers_by_width`."""
        g, shard = self._where[name]
        return g.buffer, g.bases[name], shard.rows

    def fused_grads(self, scale: float = 1.0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per buffer: the rows of every id served since the last step and their gradients times ``scale``
        (an SGD step passes ``-lr``: the bags are scaled before they are expanded to rows), repeats not
        merged; the data_parallel shards' gradients all-reduced (collective where there are any)."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        factor = scale / self.comm.size  # table gradients are averaged over the ranks
        for name, parts in self.pending.items():
            expanded = [k.rows(factor) for k in parts]
            out[name] = expanded[0] if len(expanded) == 1 else (torch.cat([i for i, _ in expanded]),
                                                                torch.cat([r for _, r in expanded]))
        if self._replicated_keys:
            for name, (ids, rows) in self._replicated_grads(factor).items():
                if name in out:
                    out[name] = (torch.cat([out[name][0], ids]), torch.cat([out[name][1], rows]))
                else:
                    out[name] = (ids, rows)
        return out

    def add_grads(self, scale: float) -> None:
        """Add ``scale`` times the gradients kept since the last step to the tables (an SGD step with
        ``-lr``), repeats added up as they come; collective where there are data_parallel tables."""
        factor = scale / self.comm.size
        buffers = self.buffers_by_width()
        for name, parts in self.pending.items():
            for kept in parts:
                kept.add_to(buffers[name], factor)
        if self._replicated_keys:
            for name, (ids, rows) in self._replicated_grads(factor).items():
                buffers[name].index_add_(0, ids, rows)

    def _replicated_grads(self, factor: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The data_parallel shards' dense gradients summed over the ranks: one all-reduce for all of them."""
        dense = []
        kept = {buffer: [k.rows(factor) for k in parts] for buffer, parts in self._pending_replicated.items()}
        for key in self._replicated_keys:
            buffer, base, rows = self.shard_rows(key)
            cols = self._where[key][1].cols
            d = torch.zeros(rows, cols, device=self.device)
            for ids, grads in kept.get(buffer, []):
                inside = (ids >= base) & (ids < base + rows)
                d.index_add_(0, ids[inside] - base, grads[inside])
            dense.append(d)
        flat = self.comm.allreduce(torch.cat([d.reshape(-1) for d in dense]))
        out: dict[str, tuple[list, list]] = {}
        pos = 0
        for key, d in zip(self._replicated_keys, dense):
            buffer, base, rows = self.shard_rows(key)
            summed = flat[pos:pos + d.numel()].view_as(d)
            pos += d.numel()
            ids, grads = out.setdefault(buffer, ([], []))
            ids.append(torch.arange(base, base + rows, device=d.device))
            grads.append(summed)
        return {k: (torch.cat(i), torch.cat(g)) for k, (i, g) in out.items()}

    def sparse_grads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per shard: the distinct local rows touched since the last step and their summed gradients
        (collective where there are data_parallel tables)."""
        out = {}
        for buffer, (ids, rows) in self.fused_grads().items():
            unique, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros(unique.numel(), rows.shape[1], dtype=rows.dtype,
                                 device=rows.device).index_add_(0, inverse, rows)
            for name in self._shard_names:
                b, base, n = self.shard_rows(name)
                if b != buffer:
                    continue
                inside = (unique >= base) & (unique < base + n)
                if bool(inside.any()):
                    out[name] = (unique[inside] - base, summed[inside])
        return out

    def clear_grads(self) -> None:
        """Drop the row gradients kept since the last step."""
        self.pending.clear()
        self._pending_replicated.clear()


def _bag_sizes(feature: FeatureIds) -> torch.Tensor:
    """``[batch, 1]``: each bag's size, at least 1 (a mean-pooled empty bag stays zero)."""
    return torch.from_numpy(np.maximum(feature.lengths, 1)).unsqueeze(1)


class _PooledLookup(torch.autograd.Function):
    """Forward: the two all-to-alls and the owners' pooling; backward: the gradients to the owners."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, module: ShardedEmbeddingBagCollection,
                kjt: KeyedJaggedTensor) -> torch.Tensor:
        with torch.no_grad():
            batch, per, sources, weights = module._exchange_ids(kjt)
            pooled, splits, saved = module._pool(sources, weights)
            got = module.comm.alltoall(pooled, splits, recv_splits=[batch * cols for cols in module._cols_to])
            local, local_saved = module._pool_local(batch, per)
            out = module._assemble(batch, per, got, local)
        ctx.module, ctx.saved = module, (batch, per, sources, saved, local_saved)
        return out

    @staticmethod
    @not_traced
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.module._backward(*ctx.saved, grad)
        return None, None, None
