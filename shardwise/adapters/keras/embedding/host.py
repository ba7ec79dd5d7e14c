"""The host side of the Keras sharded embedding bags: numpy shards, two all-to-alls forward, one backward.

:class:`HostEmbeddingEngine` mirrors
:class:`~shardwise.adapters.torch.embedding.collection.ShardedEmbeddingBagCollection` on numpy
arrays, so that it runs inside a JAX ``io_callback`` as well as under Keras-on-torch. Forward:
every rank sends each shard's owner the ids of its samples that fall into the shard, with the bag
lengths and a status word (bad input fails on every rank at once); the owners sum their rows per
bag; a second all-to-all brings the pooled blocks back, where row blocks add up and column blocks
sit side by side (mean pooling divides by the bag length here). Per-id weights (sum pooling only)
travel in a float32 all-to-all of the same layout (:func:`~shardwise.core.embedding_lookup.pack_ids`);
the owners scale each row by its weight. Backward: the pooled gradients go to the owners (a third
all-to-all), which turn them into row gradients scaled by ``1 / world_size`` (and by each id's weight)
and apply them at once (fused): SGD, element-wise Adagrad (torch's) or row-wise Adagrad (FBGEMM's and
TorchRec's: one accumulator per row of a shard holding the mean of the squared row gradient, as
:class:`~shardwise.adapters.torch.embedding.SparseOptimizer` ``("rowwise_adagrad")``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np

from ....core.comm import Communicator
from ....core.embedding_lookup import (BAD_BATCH, BAD_ID, OK, FeatureIds, Source, agree_on_tables, check_plan,
                                       check_sources, feature_ids, pack_ids, parse_ids)
from ....core.embedding_plan import EmbeddingPlan, LookupSlot, ShardingType, TableConfig, TableShard, plan_tables
from ....core.errors import ConfigError, ShapeMismatchError
from ....core.table_init import init_rows
from .... import context

__all__ = ["HostEmbeddingEngine", "OPTIMIZERS", "SHARDING_TYPES"]

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
#: The sharding types this engine runs (not ``data_parallel``: its replicas would each add their pooled rows).
SHARDING_TYPES = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE,
                  ShardingType.TABLE_ROW_WISE)
_KEEP = 8  # forward contexts kept for a backward that may follow


class HostEmbeddingEngine:
    """This rank's shards of ``tables`` (numpy float32) and the collective lookups on them.

    Every rank must call :meth:`lookup` and :meth:`backward` in the same order. ``comm``
    defaults to the world communicator; ``plan`` to :func:`plan_tables` for it.
    """

    def __init__(self, tables: Sequence[TableConfig], plan: Optional[EmbeddingPlan] = None, *,
                 comm: Optional[Communicator] = None, seed: int = 0, optimizer: str = "sgd",
                 learning_rate: float = 0.01, eps: float = 1e-10, initial_accumulator_value: float = 0.0) -> None:
        if comm is None:
            comm = context.current().world
        tables = list(tables)
        if not tables or not all(isinstance(t, TableConfig) for t in tables):
            raise ConfigError("tables must be a non-empty sequence of TableConfig")
        if optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {list(OPTIMIZERS)}, got {optimizer!r}")
        if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not learning_rate > 0:
            raise ConfigError(f"learning_rate must be a number > 0, got {learning_rate!r}")
        problem = None
        try:
            if plan is None:
                plan = plan_tables(tables, comm.size, optimizer=optimizer, sharding_types=list(SHARDING_TYPES))
            check_plan(plan, tables, comm.size)
            other = [f"{p.table.name} ({p.sharding.value})" for p in plan.placements
                     if p.sharding not in SHARDING_TYPES]
            if other:
                runs = [t.value for t in SHARDING_TYPES]
                raise ConfigError(f"the Keras embedding layer runs {runs} tables, not {other}: plan them with "
                                  f"plan_tables(..., sharding_types={runs})")
        except ConfigError as exc:  # refused on every rank below, not on this one alone
            problem = str(exc)
        agree_on_tables(comm, plan, problem)
        self.comm, self.plan, self.kind = comm, plan, optimizer
        self.lr, self.eps = float(learning_rate), float(eps)
        self.tables = {t.name: t for t in tables}
        self.features = tuple(f for t in tables for f in t.feature_names)
        self.table_of = {f: t for t in tables for f in t.feature_names}
        self.offsets: dict[str, int] = {}
        width = 0
        for f in self.features:
            self.offsets[f] = width
            width += self.table_of[f].embedding_dim
        self.width = width
        slots = [LookupSlot(f, p.table, s, f"{p.table.name}__shard{i}")
                 for p in plan.placements for i, s in enumerate(p.shards) for f in p.table.feature_names]
        slots.sort(key=lambda s: (s.shard.rank, self.features.index(s.feature), s.key))
        self._to = [[s for s in slots if s.shard.rank == d] for d in range(comm.size)]
        self.shards: dict[str, np.ndarray] = {}
        self.state: dict[str, np.ndarray] = {}
        for p in plan.placements:
            for i, s in enumerate(p.shards):
                if s.rank == comm.rank:
                    key = f"{p.table.name}__shard{i}"
                    self.shards[key] = init_rows(p.table, seed, (s.row_start, s.row_end), (s.col_start, s.col_end))
                    if optimizer == "adagrad":
                        self.state[key] = np.full_like(self.shards[key], initial_accumulator_value)
                    elif optimizer == "rowwise_adagrad":
                        self.state[key] = np.full(s.rows, initial_accumulator_value, np.float32)
        self._saved: "OrderedDict[int, tuple]" = OrderedDict()
        self._next = 0

    def shard_of(self, key: str) -> tuple[TableConfig, TableShard]:
        """The table and shard a key of :attr:`shards` holds."""
        table, index = key.rsplit("__shard", 1)
        return self.tables[table], self.plan.placement(table).shards[int(index)]

    def forget(self) -> None:
        """Drop the lookups kept for a backward (their rows are stale once the tables are loaded)."""
        self._saved.clear()

    # -- communication ------------------------------------------------------------------------
    def _alltoall(self, array: np.ndarray, splits: list[int]) -> np.ndarray:
        return np.asarray(self.comm.alltoall(array, splits))  # every backend takes (and gives back) numpy

    # -- forward ------------------------------------------------------------------------------
    def _split_ids(self, ids: Sequence[Any],
                   weights: Optional[Sequence[Any]]) -> tuple[int, int, str, dict[str, FeatureIds]]:
        if len(ids) != len(self.features):
            return 0, BAD_BATCH, f"expected {len(self.features)} features {list(self.features)}, got {len(ids)}", {}
        if weights is not None and len(weights) != len(self.features):
            return 0, BAD_BATCH, (f"expected per-id weights (or None) for {len(self.features)} features, "
                                  f"got {len(weights)}"), {}
        arrays = [np.asarray(a) for a in ids]
        batch = arrays[0].shape[0] if arrays[0].ndim else 0
        per: dict[str, FeatureIds] = {}
        for i, (f, a) in enumerate(zip(self.features, arrays)):
            if a.ndim != 2 or a.shape[0] != batch or not np.issubdtype(a.dtype, np.integer):
                return batch, BAD_BATCH, (f"feature {f!r}: expected integer ids of shape [batch={batch}, max_ids], "
                                          f"got {a.dtype} {a.shape}"), {}
            table = self.table_of[f]
            bad = (a < -1) | (a >= table.num_embeddings)
            if bad.any():
                return batch, BAD_ID, (f"feature {f!r}: id {int(a[bad][0])} is outside table {table.name!r} "
                                       f"(0 .. {table.num_embeddings - 1}; -1 pads a bag)"), {}
            w = None if weights is None or weights[i] is None or table.weighted is False else np.asarray(weights[i])
            if w is None and table.weighted:
                return batch, BAD_BATCH, (f"feature {f!r}: table {table.name!r} is weighted (weighted=True), "
                                          "but no per-id weights came for it"), {}
            if w is not None:
                if table.pooling != "sum":
                    return batch, BAD_BATCH, (f"feature {f!r}: per-id weights need sum pooling, table "
                                              f"{table.name!r} pools by {table.pooling} (as torch's EmbeddingBag)"), {}
                if w.shape != a.shape or not np.issubdtype(w.dtype, np.floating):
                    return batch, BAD_BATCH, (f"feature {f!r}: expected float weights of the ids' shape {a.shape}, "
                                              f"got {w.dtype} {w.shape}"), {}
            mask = a >= 0
            per[f] = feature_ids(a[mask], mask.sum(axis=1), None if w is None else w[mask].astype(np.float32))
        return batch, OK, "", per

    def _exchange_ids(self, ids: Sequence[Any], weights: Optional[Sequence[Any]]
                      ) -> tuple[int, dict[str, FeatureIds], list[Source], Optional[list[list[np.ndarray]]]]:
        """The id exchange; per source and slot of this rank, the ids' weights (None: no rank sent any)."""
        batch, status, message, per = self._split_ids(ids, weights)
        packets, wpackets = pack_ids(self._to, batch, status, per)
        got = self._alltoall(np.concatenate(packets), [p.size for p in packets])
        sources = parse_ids(got, self.comm.size, self._to[self.comm.rank])
        check_sources(sources, message)
        if not any(s.has_weights for s in sources):  # every rank sees every sender's flag: all skip together
            return batch, per, sources, None
        got_w = self._alltoall(np.concatenate(wpackets).astype(np.float32), [w.size for w in wpackets])
        got_w = np.asarray(got_w, np.float32)
        split, pos = [], 0
        for s in sources:  # a sender without weights sent none: its ids weigh 1
            mine = []
            for rows in s.ids:
                if s.has_weights:
                    mine.append(got_w[pos:pos + rows.size])
                    pos += rows.size
                else:
                    mine.append(np.ones(rows.size, np.float32))
            split.append(mine)
        return batch, per, sources, split

    def lookup(self, ids: Sequence[Any], save: bool = False,
               weights: Optional[Sequence[Any]] = None) -> tuple[np.ndarray, int]:
        """Pooled rows ``[batch, width]`` (float32, features side by side) of this rank's ``ids``.

        ``ids`` holds one ``[batch, max_ids]`` integer array per feature, in feature order,
        padded with ``-1``. ``weights``: None, or per feature None or float per-id weights of
        the ids' shape (sum-pooled tables only; a bag is then the weighted sum of its rows).
        With ``save`` the exchange is kept for :meth:`backward` under the returned handle
        (``-1`` without).
        """
        batch, per, sources, wsplit = self._exchange_ids(ids, weights)
        samples = [[s.sample(k) for k in range(len(s.ids))] for s in sources]  # kept for backward
        pooled = []
        for j, (s, sample) in enumerate(zip(sources, samples)):
            blocks = []
            for k, (slot, rows) in enumerate(zip(self._to[self.comm.rank], s.ids)):
                out = np.zeros((s.batch, slot.shard.cols), np.float32)
                values = self.shards[slot.key][rows]
                if wsplit is not None:
                    values = values * wsplit[j][k][:, None]
                np.add.at(out, sample[k], values)
                blocks.append(out.reshape(-1))
            pooled.append(np.concatenate(blocks) if blocks else np.zeros(0, np.float32))
        got = self._alltoall(np.concatenate(pooled), [p.size for p in pooled])
        out = np.zeros((batch, self.width), np.float32)
        pos = 0
        for slots in self._to:
            for slot in slots:
                c, first = slot.shard.cols, self.offsets[slot.feature] + slot.shard.col_start
                out[:, first:first + c] += got[pos:pos + batch * c].reshape(batch, c)
                pos += batch * c
        for f in self.features:
            t = self.table_of[f]
            if t.pooling == "mean":
                out[:, self.offsets[f]:self.offsets[f] + t.embedding_dim] /= \
                    np.maximum(per[f][1], 1)[:, None].astype(np.float32)
        handle = -1
        if save:
            handle, self._next = self._next, (self._next + 1) % (2 ** 31 - 1)
            self._saved[handle] = (batch, per, sources, samples, wsplit)
            while len(self._saved) > _KEEP:
                self._saved.popitem(last=False)
        return out, handle

    # -- backward -----------------------------------------------------------------------------
    def backward(self, handle: int, grad: Any) -> None:
        """Send the pooled gradients ``[batch, width]`` of lookup ``handle`` to the owners, which update their rows."""
        saved = self._saved.pop(int(handle), None)
        if saved is None:
            raise ShapeMismatchError(f"no saved embedding lookup {int(handle)} for this backward pass")
        batch, per, sources, samples, wsplit = saved
        grad = np.asarray(grad, np.float32)
        if grad.shape != (batch, self.width):
            raise ShapeMismatchError(f"pooled gradient of shape {grad.shape}, expected {(batch, self.width)}")
        grad = grad.copy()
        for f in self.features:
            t = self.table_of[f]
            if t.pooling == "mean":
                grad[:, self.offsets[f]:self.offsets[f] + t.embedding_dim] /= \
                    np.maximum(per[f][1], 1)[:, None].astype(np.float32)
        send = []
        for slots in self._to:
            parts = [grad[:, self.offsets[s.feature] + s.shard.col_start:
                          self.offsets[s.feature] + s.shard.col_end].reshape(-1) for s in slots]
            send.append(np.concatenate(parts) if parts else np.zeros(0, np.float32))
        got = self._alltoall(np.ascontiguousarray(np.concatenate(send)), [p.size for p in send])
        pos, scale = 0, np.float32(1.0 / self.comm.size)
        pending: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for j, (s, sample) in enumerate(zip(sources, samples)):
            b = s.batch
            for k, (slot, rows) in enumerate(zip(self._to[self.comm.rank], s.ids)):
                c = slot.shard.cols
                g = got[pos:pos + b * c].reshape(b, c)
                pos += b * c
                if rows.size:
                    row_grads = g[sample[k]] * scale
                    if wsplit is not None:
                        row_grads = row_grads * wsplit[j][k][:, None]
                    pending.setdefault(slot.key, []).append((rows, row_grads))
        self._apply(pending)

    def _apply(self, pending: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> None:
        """The fused sparse update: each touched row once, with its summed gradient."""
        for key, parts in pending.items():
            rows = np.concatenate([r for r, _ in parts])
            grads = np.concatenate([g for _, g in parts])
            unique, inverse = np.unique(rows, return_inverse=True)
            summed = np.zeros((unique.size, grads.shape[1]), np.float32)
            np.add.at(summed, inverse.reshape(-1), grads)
            weight = self.shards[key]
            lr, eps = np.float32(self.lr), np.float32(self.eps)
            if self.kind == "sgd":
                weight[unique] -= lr * summed
            elif self.kind == "adagrad":
                acc = self.state[key]
                acc[unique] += summed * summed
                weight[unique] -= lr * summed / (np.sqrt(acc[unique]) + eps)
            else:  # rowwise_adagrad: one accumulator per row, the mean of its squared gradient
                acc = self.state[key]
                acc[unique] += (summed * summed).mean(axis=1)
                weight[unique] -= lr * summed / (np.sqrt(acc[unique]) + eps)[:, None]
