"""Sequence embeddings: one row per id, unpooled, over tables split by an embedding plan (TorchRec's
sharded ``EmbeddingCollection``, for transformer-based recommenders).

The ids travel as in :mod:`.collection` (one all-to-all to the table shards' owners, with the bag
lengths and a status word so that bad input fails on every rank at once). The owners return the
row block of every id they got (a second all-to-all), and the sender puts each block back at its
id's position (:mod:`shardwise.core.sequence_lookup`): a row-wise table's rows come from several
owners and are put back in id order, a column-wise table's column blocks side by side. Backward
sends each id's row gradient block to its owner (a third all-to-all), which keeps it for
:class:`~.sparse_optim.SparseOptimizer`. Table gradients are averaged over the ranks, as data
parallelism averages the dense ones. A ``data_parallel`` table (replicated) is looked up
locally from this rank's copy; its gradients are all-reduced when the optimizer reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ....core.comm import Communicator
from ....core.embedding_lookup import (BAD_BATCH, BAD_ID, OK, FeatureIds, Source,
                                       check_sources, feature_ids, pack_ids, parse_ids)
from ....core.embedding_plan import EmbeddingPlan, LookupSlot, ShardingType, TableConfig, TableShard
from ....core.errors import ConfigError, ShapeMismatchError
from ....core.sequence_lookup import route_rows
from ..compiling import not_traced
from .jagged import KeyedJaggedTensor
from .planned import planned_tables
from .table_init import init_rows
from .torchrec_interop import as_kjt, as_table_configs, is_torchrec

__all__ = ["JaggedTensor", "ShardedEmbeddingCollection"]


@dataclass(frozen=True)
class JaggedTensor:
    """One feature's rows for a batch (TorchRec's ``JaggedTensor``): ``values[n_ids, dim]`` holds the
    row of every id in bag order, ``lengths[batch]`` the number of ids of each sample."""

    values: torch.Tensor
    lengths: torch.Tensor

    def __post_init__(self) -> None:
        if self.lengths.dim() != 1 or self.values.dim() < 1:
            raise ShapeMismatchError(f"lengths must be 1-D and values at least 1-D, got {tuple(self.lengths.shape)} "
                                     f"and {tuple(self.values.shape)}")
        if int(self.lengths.sum()) != self.values.shape[0]:
            raise ShapeMismatchError(f"lengths add up to {int(self.lengths.sum())}, but there are "
                                     f"{self.values.shape[0]} values")

    @property
    def batch_size(self) -> int:
        """Samples."""
        return self.lengths.numel()

    def offsets(self) -> torch.Tensor:
        """``[batch + 1]``: where each sample's rows start in ``values``, then their total."""
        return torch.cat([self.lengths.new_zeros(1), torch.cumsum(self.lengths, 0)])

    def to_dense(self) -> list[torch.Tensor]:
        """Each sample's rows, ``[length_i, ...]``."""
        return list(torch.split(self.values, self.lengths.tolist()))

    def to_padded_dense(self, desired_length: Optional[int] = None, padding_value: float = 0.0) -> torch.Tensor:
        """``[batch, L, ...]``: each sample's rows, padded with ``padding_value`` (or cut) to ``L`` =
        ``desired_length`` (the longest sample where None). Differentiable in ``values``."""
        lengths = self.lengths.to(self.values.device)
        length = int(lengths.max()) if desired_length is None and lengths.numel() else int(desired_length or 0)
        if length < 0:
            raise ShapeMismatchError(f"desired_length must be >= 0, got {desired_length}")
        out = self.values.new_full((self.batch_size, length, *self.values.shape[1:]), padding_value)
        sample = torch.repeat_interleave(torch.arange(self.batch_size, device=lengths.device), lengths)
        position = torch.arange(self.values.shape[0], device=lengths.device) - \
            (torch.cumsum(lengths, 0) - lengths)[sample]
        keep = position < length
        return out.index_put((sample[keep], position[keep]), self.values[keep])


def _table_configs(tables: Any) -> list[TableConfig]:
    """shardwise :class:`TableConfig` s for ``tables``: ours, TorchRec ``EmbeddingConfig`` s (or an
    ``EmbeddingCollection``, for its configs: name, rows, width, features) or what
    :func:`~.torchrec_interop.as_table_configs` takes."""
    if is_torchrec(tables, "EmbeddingCollectionInterface"):
        tables = tables.embedding_configs()
    out = []
    for t in tables:
        if not is_torchrec(t, "EmbeddingConfig"):
            out.extend(as_table_configs([t]))
            continue
        data_type = str(getattr(t.data_type, "name", t.data_type))
        if data_type != "FP32":
            raise ConfigError(f"table {t.name!r}: data_type {data_type} cannot be expressed; shardwise's tables "
                              "are FP32")
        out.append(TableConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                               feature_names=tuple(t.feature_names)))
    return out


class ShardedEmbeddingCollection(nn.Module):
    """Unpooled embedding lookups over tables split by an :class:`EmbeddingPlan` (any sharding type,
    ``data_parallel`` included).

    ``forward(kjt)`` takes this rank's batch as a :class:`KeyedJaggedTensor` (shardwise's or
    TorchRec's) holding every feature of the tables and returns ``{feature: JaggedTensor}`` whose
    values are the ids' rows in bag order, as ``nn.Embedding(values)`` of the whole table would give.
    A feature no table has is refused on every rank, unless ``ignore_unknown_features`` (then it is
    dropped). Collective: every rank calls it (and backward) in the same order, with batches of any
    size (none included). ``tables`` are :class:`TableConfig` or TorchRec ``EmbeddingConfig``
    objects; their ``pooling`` is not used (there is none), nor are per-id weights. The shards are buffers
    (``model.parameters()`` stays the dense part); their gradients are kept for a
    :class:`~.sparse_optim.SparseOptimizer`. Initial values are :func:`~.table_init.init_rows` of
    ``seed``, those of the whole tables (:func:`~.table_init.full_table`) built in one process.
    """

    def __init__(self, tables: Sequence[Any], plan: Optional[EmbeddingPlan] = None, *,
                 comm: Optional[Communicator] = None, seed: int = 0, optimizer: str = "sgd",
                 global_batch: int = 1024, ignore_unknown_features: bool = False) -> None:
        super().__init__()
        comm, tables, plan = planned_tables(tables, plan, comm, convert=_table_configs, optimizer=optimizer,
                                            global_batch=global_batch)
        self.comm = comm
        self.ignore_unknown_features = bool(ignore_unknown_features)
        self.plan, self.tables = plan, {t.name: t for t in tables}
        self._table_of = {f: t for t in tables for f in t.feature_names}
        self.features = tuple(self._table_of)
        slots = [LookupSlot(f, p.table, shard, f"{p.table.name}__shard{i}")
                 for p in plan.placements for i, shard in enumerate(p.shards) for f in p.table.feature_names]
        replicated = {p.table.name for p in plan.placements if p.sharding is ShardingType.DATA_PARALLEL}
        #: data_parallel features, looked up here in this rank's copy (shard ``rank``)
        self._local = [s for s in slots if s.table.name in replicated and s.shard.rank == comm.rank]
        slots = [s for s in slots if s.table.name not in replicated]
        slots.sort(key=lambda s: (s.shard.rank, self.features.index(s.feature), s.key))
        self._to: list[list[LookupSlot]] = [[s for s in slots if s.shard.rank == d] for d in range(comm.size)]
        #: this rank's copies of the data_parallel tables, in plan order (the same on every rank)
        self._replicated_keys = list(dict.fromkeys(s.key for s in self._local))
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
        """Where this rank's shards live: rows and their gradients are exchanged there; ids on the host."""
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

    @not_traced  # all-to-alls: a compiled model breaks its graph here and runs this eagerly
    def forward(self, kjt: Any) -> dict[str, JaggedTensor]:
        kjt = as_kjt(kjt)
        rows = _SequenceLookup.apply(self._anchor, self, kjt)
        return {f: JaggedTensor(r, kjt.feature(f)[1]) for f, r in zip(self.features, rows)}

    # -- forward: ids to the owners, their rows back -----------------------------------------------
    def _split_ids(self, kjt: KeyedJaggedTensor) -> tuple[int, int, str, dict[str, FeatureIds]]:
        """Per feature its ids and bag lengths on the host; a status word and its message."""
        unknown = [k for k in kjt.keys if k not in self._table_of]
        missing = [f for f in self.features if f not in kjt.keys]
        problems = []
        if unknown and not self.ignore_unknown_features:
            problems.append(f"features {unknown} are in no table of this collection (its features: "
                            f"{list(self.features)}); pass ignore_unknown_features=True to drop such features")
        if missing:
            problems.append(f"features {missing} are missing from the batch")
        if problems:
            return kjt.batch_size, BAD_BATCH, "; ".join(problems), {}
        per: dict[str, FeatureIds] = {}
        for f in self.features:
            values, lengths, _ = kjt.feature(f)
            values, lengths = values.cpu(), lengths.cpu()
            table = self._table_of[f]
            bad = (values < 0) | (values >= table.num_embeddings)
            if bool(bad.any()):
                return kjt.batch_size, BAD_ID, (f"feature {f!r}: id {int(values[bad][0])} is outside table "
                                                f"{table.name!r} (0 .. {table.num_embeddings - 1})"), {}
            per[f] = feature_ids(values.numpy(), lengths.numpy())
        return kjt.batch_size, OK, "", per

    def _exchange_ids(self, kjt: KeyedJaggedTensor) -> tuple[dict[str, FeatureIds], list[Source]]:
        """The id exchange (:mod:`shardwise.core.embedding_lookup`): what every sender asks of this rank."""
        batch, status, message, per = self._split_ids(kjt)
        packets, _ = pack_ids(self._to, batch, status, per)
        got = self.comm.alltoall(np.concatenate(packets), [p.size for p in packets])
        sources = parse_ids(np.asarray(got), self.comm.size, self._to[self.comm.rank])
        check_sources(sources, message)
        return per, sources

    def _serve(self, sources: Sequence[Source]) -> list[torch.Tensor]:
        """Per source: the rows of the ids it sent, slot after slot, flattened."""
        out = []
        for s in sources:
            blocks = [self.shard(slot.key)[torch.from_numpy(ids).to(self.device)].reshape(-1)
                      for slot, ids in zip(self._to[self.comm.rank], s.ids)]
            out.append(torch.cat(blocks) if blocks else torch.zeros(0, device=self.device))
        return out

    def _assemble(self, per: dict[str, FeatureIds], where: list[list[np.ndarray]],
                  got: torch.Tensor) -> list[torch.Tensor]:
        """Each feature's ``[n_ids, dim]`` rows from the blocks every owner returned, in id order (and
        those of the data_parallel features from this rank's copy)."""
        out = {f: torch.zeros(per[f].values.size, self._table_of[f].embedding_dim, device=got.device,
                              dtype=got.dtype) for f in self.features}
        pos = 0
        for slots, positions in zip(self._to, where):
            for slot, at in zip(slots, positions):
                n, cols = at.size, slot.shard.cols
                out[slot.feature][torch.from_numpy(at).to(got.device), slot.shard.col_start:slot.shard.col_end] = \
                    got[pos:pos + n * cols].view(n, cols)
                pos += n * cols
        for slot in self._local:
            out[slot.feature] = self.shard(slot.key)[torch.from_numpy(per[slot.feature].values).to(self.device)]
        return [out[f] for f in self.features]

    # -- backward: the rows' gradients to their owners, kept per shard -------------------------------
    def _backward(self, per: dict[str, FeatureIds], where: list[list[np.ndarray]], sources: Sequence[Source],
                  grads: Sequence[torch.Tensor]) -> None:
        by_feature = dict(zip(self.features, grads))
        scale = 1.0 / self.comm.size
        for slot in self._local:  # all-reduced in sparse_grads
            ids = torch.from_numpy(per[slot.feature].values).to(self.device)
            if ids.numel():
                self.pending.setdefault(slot.key, []).append((ids, by_feature[slot.feature] * scale))
        send = []
        for slots, positions in zip(self._to, where):
            blocks = [by_feature[slot.feature][torch.from_numpy(at).to(self.device),
                                               slot.shard.col_start:slot.shard.col_end].reshape(-1)
                      for slot, at in zip(slots, positions)]
            send.append(torch.cat(blocks) if blocks else torch.zeros(0, device=self.device))
        got = self.comm.alltoall(torch.cat(send).contiguous(), [t.numel() for t in send])
        pos = 0
        for s in sources:
            for slot, ids in zip(self._to[self.comm.rank], s.ids):
                n, cols = ids.size, slot.shard.cols
                rows = got[pos:pos + n * cols].view(n, cols) * scale
                pos += n * cols
                if n:
                    self.pending.setdefault(slot.key, []).append((torch.from_numpy(ids).to(rows.device), rows))

    def clear_grads(self) -> None:
        """Drop the pending row gradients (what an optimizer step or ``zero_grad`` does)."""
        self.pending.clear()

    def sparse_grads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per shard: the distinct local rows touched since the last step and their summed gradients; for
        the copy of a data_parallel table, every row and its gradient averaged over the ranks (collective
        where there are data_parallel tables: every rank calls it as often)."""
        out = self._replicated_grads()
        for key, parts in self.pending.items():
            if key in out:
                continue
            ids = torch.cat([i for i, _ in parts])
            rows = torch.cat([r for _, r in parts])
            unique, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros(unique.numel(), rows.shape[1], dtype=rows.dtype,
                                 device=rows.device).index_add_(0, inverse, rows)
            out[key] = (unique, summed)
        return out


    def _replicated_grads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The data_parallel copies' dense gradients summed over the ranks, in one all-reduce."""
        if not self._replicated_keys:
            return {}
        dense = []
        for key in self._replicated_keys:
            weight = self.shard(key)
            d = torch.zeros_like(weight)
            for ids, rows in self.pending.get(key, []):
                d.index_add_(0, ids, rows)
            dense.append(d)
        flat = self.comm.allreduce(torch.cat([d.reshape(-1) for d in dense]))
        out, pos = {}, 0
        for key, d in zip(self._replicated_keys, dense):
            out[key] = (torch.arange(d.shape[0], device=d.device), flat[pos:pos + d.numel()].view_as(d))
            pos += d.numel()
        return out


class _SequenceLookup(torch.autograd.Function):
    """Forward: the two all-to-alls and the owners' row reads; backward: the row gradients to the owners."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, module: ShardedEmbeddingCollection,
                kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            per, sources = module._exchange_ids(kjt)
            served = module._serve(sources)
            got = module.comm.alltoall(torch.cat(served), [t.numel() for t in served])
            where = route_rows(module._to, per)
            rows = module._assemble(per, where, got)
        ctx.module, ctx.saved = module, (per, where, sources)
        return tuple(rows)

    @staticmethod
    @not_traced
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.module._backward(*ctx.saved, grads)
        return None, None, None
