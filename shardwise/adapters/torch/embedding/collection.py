"""Embedding-bag tables split over ranks, looked up with two all-to-alls (TorchRec's sharded EBC).

Each rank feeds its own samples' ids. Forward: every rank sends each table shard's owner the ids
of its samples that fall into the shard (one all-to-all, with the bag lengths and a status word
so that bad input fails on every rank at once), the owners pool their rows per bag, and a second
all-to-all brings the pooled rows back to the samples' ranks, which add up the row blocks of a
row-wise table and put the column blocks of a column-wise one side by side. Backward mirrors
it: the pooled rows' gradients go to the owners (a third all-to-all), which turn them into row
gradients of the ids they served and keep them for :class:`~.sparse_optim.SparseOptimizer`.
Table gradients are averaged over the ranks, as data parallelism averages the dense ones.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ....core.comm import Communicator
from ....core.embedding_lookup import (BAD_BATCH, BAD_ID, OK, FeatureIds, agree_on_tables, check_plan, check_sources,
                                       feature_ids, pack_ids, parse_ids, split_weights)
from ....core.embedding_plan import EmbeddingPlan, LookupSlot, TableConfig, TableShard, plan_tables
from ....core.errors import ConfigError, ShapeMismatchError
from ..compiling import not_traced
from .jagged import KeyedJaggedTensor
from .table_init import init_rows
from ....context import current

__all__ = ["ShardedEmbeddingBagCollection"]



def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lengths, 0) - lengths


def _bag_sizes(feature: FeatureIds) -> torch.Tensor:
    """``[batch, 1]``: each bag's size, at least 1 (a mean-pooled empty bag stays zero)."""
    return torch.from_numpy(np.maximum(feature.lengths, 1)).unsqueeze(1)


class ShardedEmbeddingBagCollection(nn.Module):
    """Sum- or mean-pooled embedding bags over tables split by an :class:`EmbeddingPlan`.

    ``forward(kjt)`` takes this rank's batch as a :class:`KeyedJaggedTensor` holding every
    feature of the tables and returns ``{feature: [batch, embedding_dim]}``. Collective: every
    rank calls it (and backward) in the same order, with batches of any size. The shards are
    buffers (``model.parameters()`` stays the dense part for a data-parallel optimizer); their
    gradients are kept for a :class:`~.sparse_optim.SparseOptimizer`. Initial values are
    :func:`~.table_init.init_rows` of ``seed``: those of the whole tables built in one process.
    """

    def __init__(self, tables: Sequence[TableConfig], plan: Optional[EmbeddingPlan] = None, *,
                 comm: Optional[Communicator] = None, seed: int = 0, optimizer: str = "sgd",
                 global_batch: int = 1024) -> None:
        super().__init__()
        if comm is None:
            ctx = current()
            comm, local = ctx.world, ctx.local_size
        else:
            local = comm.size
        self.comm = comm
        tables = list(tables)
        problem = None
        try:
            if plan is None:
                plan = plan_tables(tables, comm.size, local_size=local if comm.size % local == 0 else comm.size,
                                   optimizer=optimizer, global_batch=global_batch)
            check_plan(plan, tables, comm.size)
        except ConfigError as exc:  # refused on every rank below, not on this one alone
            problem = str(exc)
        agree_on_tables(comm, plan, problem)
        self.plan, self.tables = plan, {t.name: t for t in tables}
        self.features = tuple(f for t in tables for f in t.feature_names)
        self.slots: list[LookupSlot] = []
        for p in plan.placements:
            for i, shard in enumerate(p.shards):
                for f in p.table.feature_names:
                    self.slots.append(LookupSlot(f, p.table, shard, f"{p.table.name}__shard{i}"))
        self.slots.sort(key=lambda s: (s.shard.rank, self.features.index(s.feature), s.key))
        self._to = [[s for s in self.slots if s.shard.rank == d] for d in range(comm.size)]
        for p in plan.placements:
            for i, shard in enumerate(p.shards):
                if shard.rank == comm.rank:
                    self.register_buffer(f"{p.table.name}__shard{i}", init_rows(
                        p.table, seed, (shard.row_start, shard.row_end), (shard.col_start, shard.col_end)))
        self._anchor = torch.zeros((), requires_grad=True)
        #: shard name -> pending (local row ids, row gradients) pairs, summed at the optimizer step
        self.pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def device(self) -> torch.device:
        """Where this rank's shards live (move them with ``.to(device)``): pooled rows and their
        gradients are computed and exchanged there; ids are exchanged and parsed on the host."""
        return next((b.device for b in self.buffers()), torch.device("cpu"))

    def shard_names(self) -> list[str]:
        """Buffer names of the shards this rank holds."""
        return [name for name, _ in self.named_buffers()]

    def shard(self, name: str) -> torch.Tensor:
        """The values of one shard this rank holds (``shard_names()``), in place: writing them changes the table."""
        return getattr(self, name)

    def shard_of(self, name: str) -> tuple[TableConfig, TableShard]:
        """The table and shard a buffer holds."""
        table, index = name.rsplit("__shard", 1)
        return self.tables[table], self.plan.placement(table).shards[int(index)]

    # -- forward: ids to the owners, pooled rows back --------------------------------------------
    def _split_ids(self, kjt: KeyedJaggedTensor) -> tuple[int, int, str, dict[str, FeatureIds]]:
        """Per feature its ids, bag lengths and weights on the host; a status word and its message.

        Ids go to the host here: their packets are cut and parsed by value (sizes read as
        Python ints), which on a GPU would cost a synchronisation per read.
        """
        missing = [f for f in self.features if f not in kjt.keys]
        if missing:
            return kjt.batch_size, BAD_BATCH, f"features {missing} are missing from the batch", {}
        per: dict[str, FeatureIds] = {}
        batch = kjt.batch_size
        for f in self.features:
            values, lengths, weights = kjt.feature(f)
            values, lengths = values.cpu(), lengths.cpu()
            table = self._table(f)
            if weights is not None and table.pooling == "mean":
                return batch, BAD_BATCH, (f"feature {f!r}: per-id weights need sum pooling, table {table.name!r} "
                                          "pools by mean (as torch's EmbeddingBag)"), {}
            bad = (values < 0) | (values >= table.num_embeddings)
            if bool(bad.any()):
                return batch, BAD_ID, (f"feature {f!r}: id {int(values[bad][0])} is outside table "
                                       f"{table.name!r} (0 .. {table.num_embeddings - 1})"), {}
            per[f] = feature_ids(values.numpy(), lengths.numpy(),
                                 None if weights is None else weights.detach().cpu().float().numpy())
        return batch, OK, "", per

    def _exchange_ids(self, kjt: KeyedJaggedTensor) -> tuple[int, dict[str, FeatureIds], list[dict]]:
        """The id exchange (:mod:`shardwise.core.embedding_lookup`); per source, this rank's slots' lengths,
        ids and weights as CPU tensors."""
        batch, status, message, per = self._split_ids(kjt)
        packets, weights = pack_ids(self._to, batch, status, per)
        got = self.comm.alltoall(np.concatenate(packets), [p.size for p in packets])
        parsed = parse_ids(np.asarray(got), self.comm.size, self._to[self.comm.rank])
        check_sources(parsed, message)
        mine = self._to[self.comm.rank]
        sources = [{"batch": s.batch, "lengths": {slot: torch.from_numpy(n) for slot, n in zip(mine, s.lengths)},
                    "ids": {slot: torch.from_numpy(i) for slot, i in zip(mine, s.ids)}} for s in parsed]
        if any(s.has_weights for s in parsed):
            got_w = self.comm.alltoall(np.concatenate(weights), [w.size for w in weights])
            for s, ws in zip(sources, split_weights(np.asarray(got_w), parsed)):
                s["weights"] = {slot: torch.from_numpy(w) for slot, w in zip(mine, ws)}
        return batch, per, sources

    def _pool(self, sources: list[dict]) -> list[torch.Tensor]:
        """Per source: this rank's pooled row blocks of every slot, flattened."""
        out = []
        for s in sources:
            blocks = []
            for slot in self._to[self.comm.rank]:
                weight = self.shard(slot.key)
                w = s.get("weights", {}).get(slot)
                dev = weight.device
                blocks.append(F.embedding_bag(s["ids"][slot].to(dev), weight, _offsets(s["lengths"][slot]).to(dev),
                                              mode="sum", per_sample_weights=None if w is None else w.to(dev)
                                              ).reshape(-1))
            out.append(torch.cat(blocks) if blocks else torch.zeros(0, device=self.device))
        return out

    def _assemble(self, batch: int, per: dict[str, tuple], got: torch.Tensor) -> list[torch.Tensor]:
        outputs = {f: torch.zeros(batch, self._table(f).embedding_dim, device=got.device) for f in self.features}
        pos = 0
        for slots in self._to:
            for slot in slots:
                cols = slot.shard.cols
                outputs[slot.feature][:, slot.shard.col_start:slot.shard.col_end] += \
                    got[pos:pos + batch * cols].view(batch, cols)
                pos += batch * cols
        for f in self.features:
            if self._table(f).pooling == "mean":
                outputs[f] /= _bag_sizes(per[f]).to(outputs[f].device, outputs[f].dtype)
        return [outputs[f] for f in self.features]

    def _table(self, feature: str) -> TableConfig:
        return next(t for t in self.tables.values() if feature in t.feature_names)

    @not_traced  # all-to-alls: a compiled model breaks its graph here and runs this eagerly
    def forward(self, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        if not isinstance(kjt, KeyedJaggedTensor):
            raise ShapeMismatchError(f"expected a KeyedJaggedTensor, got {type(kjt).__name__}")
        pooled = _PooledLookup.apply(self._anchor, self, kjt)
        return dict(zip(self.features, pooled))

    # -- backward: pooled gradients to the owners, row gradients kept -----------------------------
    def _backward(self, batch: int, per: dict[str, tuple], sources: list[dict], grads: Sequence[torch.Tensor]) -> None:
        by_feature = {}
        for f, g in zip(self.features, grads):
            if self._table(f).pooling == "mean":
                g = g / _bag_sizes(per[f]).to(g.device, g.dtype)
            by_feature[f] = g
        send = [torch.cat([by_feature[s.feature][:, s.shard.col_start:s.shard.col_end].reshape(-1)
                           for s in slots]) if slots else torch.zeros(0, device=self.device) for slots in self._to]
        got = self.comm.alltoall(torch.cat(send).contiguous(), [t.numel() for t in send])
        pos, scale = 0, 1.0 / self.comm.size
        for s in sources:
            b = s["batch"]
            for slot in self._to[self.comm.rank]:
                cols = slot.shard.cols
                g = got[pos:pos + b * cols].view(b, cols)
                pos += b * cols
                ids = s["ids"][slot]
                if not ids.numel():
                    continue
                sample = torch.repeat_interleave(torch.arange(b, device=g.device), s["lengths"][slot].to(g.device))
                rows = g[sample] * scale
                w = s.get("weights", {}).get(slot)
                if w is not None:
                    rows = rows * w.to(g.device).unsqueeze(1)
                self.pending.setdefault(slot.key, []).append((ids.to(g.device), rows))

    def sparse_grads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per shard: the distinct local rows touched since the last step and their summed gradients."""
        out = {}
        for key, parts in self.pending.items():
            ids = torch.cat([i for i, _ in parts])
            rows = torch.cat([r for _, r in parts])
            unique, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros(unique.numel(), rows.shape[1], dtype=rows.dtype,
                                 device=rows.device).index_add_(0, inverse, rows)
            out[key] = (unique, summed)
        return out


class _PooledLookup(torch.autograd.Function):
    """Forward: the two all-to-alls and the owners' pooling; backward: the gradients to the owners."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, module: ShardedEmbeddingBagCollection,
                kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            batch, per, sources = module._exchange_ids(kjt)
            pooled = module._pool(sources)
            got = module.comm.alltoall(torch.cat(pooled), [p.numel() for p in pooled])
            outputs = module._assemble(batch, per, got)
        ctx.module, ctx.saved = module, (batch, per, sources)
        return tuple(outputs)

    @staticmethod
    @not_traced
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.module._backward(*ctx.saved, grads)
        return None, None, None
