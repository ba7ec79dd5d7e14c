"""How the embedding tables of a recommendation model are split over ranks, and why.

Each table is placed by one of five sharding types, TorchRec's:

- ``table_wise``: one rank holds the whole table;
- ``row_wise``: every rank holds a block of rows (the remainder rows to the lowest ranks);
- ``column_wise``: ``k`` ranks each hold ``dim / k`` columns of every row;
- ``table_row_wise``: row-wise over the ranks of one node (the partial sums stay in the node).
  On one node (``local_size == world_size >= 2``) it is row-wise within that node, the same
  shards and cost as ``row_wise``; the planner weighs both and on that tie keeps ``row_wise``;
- ``data_parallel``: every rank holds the whole table (replicated). Its placement has one
  :class:`TableShard` per rank, all rows and columns, in rank order: shard ``i`` is on rank ``i``
  (:attr:`TablePlacement.replicated`). Each rank looks up its own samples' ids locally (no
  all-to-all); backward all-reduces the table's dense gradient, so every replica takes the same step.

:func:`plan_tables` takes the tables largest first and gives each the cheapest placement that
fits the memory budget of the ranks it lands on. The cost of a placement is its communication
time of one step, plus its lookup time (row elements read and a fixed cost per shard) shared over
the ranks, plus how much later the busiest rank finishes once it is placed; all are explained per
table (:meth:`EmbeddingPlan.explain`). The communication of the sharded types is their all-to-all
volume (ids to the owners, pooled rows back, their gradients forward again); that of
``data_parallel`` is a ring all-reduce of the table's whole dense gradient, ``2 (w - 1) / w`` times
its bytes per rank (modelled as the dense gradient, not as the rows touched), while its
lookups read only each rank's own samples. So small tables whose gradient is lighter than the
pooled rows an all-to-all would move are replicated where the budget allows the whole table (and
its optimizer state) on every rank. A table that one rank cannot hold goes column-wise over the
fewest ranks that can, or row-wise.

``constraints`` name, per table, the one type it must take or a list of the types it may take
(TorchRec's ``ParameterConstraints.sharding_types``); ``sharding_types`` the types the caller's
runtime runs at all. The memory budget holds for forced types too: a forced type that does not fit
is refused saying the budget is the problem, a type that cannot exist at this world size saying so.
Pure Python: no framework is imported.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

from .errors import ConfigError

__all__ = ["ShardingType", "Constraint", "TableConfig", "TableShard", "TablePlacement", "EmbeddingPlan", "LookupSlot",
           "plan_tables", "balanced_rows", "OPTIMIZER_STATE_PER_ELEMENT"]

#: fp32 optimizer state per table element: SGD none, Adagrad one per element, row-wise Adagrad one per row.
OPTIMIZER_STATE_PER_ELEMENT = {"sgd": 0.0, "adagrad": 1.0, "rowwise_adagrad": 0.0}
_ID_BYTES, _VALUE_BYTES = 8, 4


class ShardingType(str, enum.Enum):
    """How one table is split (TorchRec's names)."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    DATA_PARALLEL = "data_parallel"
    """Replicated on every rank: one whole-table shard per rank, in rank order; gradients all-reduced."""


#: A constraint: one sharding type (or its name), or the types (or names) a table may take.
Constraint = Union[str, ShardingType, Sequence[Union[str, ShardingType]]]


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One embedding table and the sparse features looked up in it."""

    name: str
    """Table name (unique in the collection)."""
    num_embeddings: int
    """Rows: the ids of the table are ``0 .. num_embeddings - 1``."""
    embedding_dim: int
    """Columns: the width of a row and of a pooled output."""
    feature_names: tuple[str, ...] = ()
    """Features looked up in this table; empty means one feature named like the table."""
    pooling: str = "sum"
    """How a bag of rows is pooled: ``"sum"`` or ``"mean"``."""
    ids_per_sample: float = 1.0
    """Average ids per sample and feature (the pooling factor), for the cost model."""
    weighted: Optional[bool] = None
    """Whether the per-id weights of a batch scale this table's rows: ``None`` where the batch carries
    weights and the table pools by sum (a mean-pooled table ignores them, as torch's EmbeddingBag
    weighs sum-pooled bags only), ``True`` always (a batch without weights is refused), ``False`` never
    (so weighted and unweighted features share one batch and one collection)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a table needs a non-empty name, got {self.name!r}")
        for key in ("num_embeddings", "embedding_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"table {self.name!r}: {key} must be an integer >= 1, got {value!r}")
        if self.pooling not in ("sum", "mean"):
            raise ConfigError(f"table {self.name!r}: pooling must be 'sum' or 'mean', got {self.pooling!r}")
        if isinstance(self.ids_per_sample, bool) or not isinstance(self.ids_per_sample, (int, float)) \
                or self.ids_per_sample < 0:
            raise ConfigError(f"table {self.name!r}: ids_per_sample must be a number >= 0, "
                              f"got {self.ids_per_sample!r}")
        if self.weighted is not None and not isinstance(self.weighted, bool):
            raise ConfigError(f"table {self.name!r}: weighted must be True, False or None, got {self.weighted!r}")
        if self.weighted and self.pooling == "mean":
            raise ConfigError(f"table {self.name!r}: per-id weights need sum pooling (torch's EmbeddingBag "
                              "weighs sum-pooled bags only); this table pools by mean")
        features = tuple(self.feature_names) or (self.name,)
        if any(not isinstance(f, str) or not f for f in features) or len(set(features)) != len(features):
            raise ConfigError(f"table {self.name!r}: feature_names must be distinct non-empty strings, "
                              f"got {self.feature_names!r}")
        object.__setattr__(self, "feature_names", features)

    @property
    def elements(self) -> int:
        """``num_embeddings x embedding_dim``."""
        return self.num_embeddings * self.embedding_dim


@dataclass(frozen=True)
class TableShard:
    """Rows ``[row_start, row_end)`` and columns ``[col_start, col_end)`` of a table, held by ``rank``."""

    table: str
    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def rows(self) -> int:
        """Rows held."""
        return self.row_end - self.row_start

    @property
    def cols(self) -> int:
        """Columns held."""
        return self.col_end - self.col_start


@dataclass(frozen=True)
class LookupSlot:
    """One feature looked up in one shard of its table: a unit of the lookups' all-to-alls."""

    feature: str
    table: TableConfig
    shard: TableShard
    key: str
    """Name of the shard on its owner (``<table>__shard<index>``)."""

    @property
    def full_rows(self) -> bool:
        """Whether the shard holds every row (table- or column-wise), so no id needs filtering."""
        return self.shard.row_start == 0 and self.shard.row_end == self.table.num_embeddings


@dataclass(frozen=True)
class TablePlacement:
    """A table, how it is split, its shards (in a fixed order every rank agrees on) and why."""

    table: TableConfig
    sharding: ShardingType
    shards: tuple[TableShard, ...]
    comm_bytes: int = 0
    """Bytes this table's lookups move between ranks per step (forward and backward); for
    ``data_parallel``, the bytes each rank sends in its gradient's ring all-reduce."""
    reason: str = ""

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole table (``data_parallel``): shard ``i`` is on rank ``i``,
        each rank looks up its own samples and the gradients are all-reduced."""
        return self.sharding is ShardingType.DATA_PARALLEL


def balanced_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous row blocks of ``rows``, sizes differing by at most one, larger ones first."""
    base, extra = divmod(rows, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class EmbeddingPlan:
    """Every table's placement over ``world_size`` ranks (nodes of ``local_size``)."""

    world_size: int
    local_size: int
    placements: tuple[TablePlacement, ...]
    optimizer: str = "sgd"
    memory_budget: int = 0
    """Bytes per rank the plan was made for (tables and their optimizer state)."""
    memory_per_rank: tuple[int, ...] = field(default=())
    """Bytes of tables and optimizer state each rank holds."""

    def placement(self, table: str) -> TablePlacement:
        """The placement of ``table``."""
        for p in self.placements:
            if p.table.name == table:
                return p
        raise ConfigError(f"no table {table!r} in the plan; tables: {[p.table.name for p in self.placements]}")

    def shards_of(self, rank: int) -> list[TableShard]:
        """The shards ``rank`` holds, in plan order."""
        return [s for p in self.placements for s in p.shards if s.rank == rank]

    def explain(self) -> str:
        """One line per table: its size, the sharding chosen and the reason; then memory per rank."""
        lines = [f"{len(self.placements)} tables over {self.world_size} ranks ({self.local_size} per node), "
                 f"optimizer {self.optimizer}, budget {_mib(self.memory_budget)} per rank:"]
        for p in self.placements:
            t = p.table
            lines.append(f"  {t.name}: {t.num_embeddings:,} x {t.embedding_dim} ({_mib(t.elements * _VALUE_BYTES)}), "
                         f"{len(t.feature_names)} feature(s), {t.ids_per_sample:g} ids/sample -> {p.sharding.value} "
                         f"on rank(s) {sorted({s.rank for s in p.shards})}: {p.reason}")
        lines.append("  memory per rank: " + ", ".join(_mib(m) for m in self.memory_per_rank))
        return "\n".join(lines)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _table_bytes(t: TableConfig, elements: float, optimizer: str) -> float:
    state = OPTIMIZER_STATE_PER_ELEMENT[optimizer] * elements
    if optimizer == "rowwise_adagrad":  # one value per row held
        state = elements / t.embedding_dim
    return (elements + state) * _VALUE_BYTES


def _options(t: TableConfig, world: int, local: int, memory: list[float],
             work: list[float]) -> list[tuple[ShardingType, list[TableShard]]]:
    """Candidate placements of ``t``, in a fixed order (the first of equal costs wins): each type on the
    least loaded ranks (by memory, then lookup work), ``data_parallel`` last, on every rank in rank order."""
    order = sorted(range(world), key=lambda r: (memory[r], work[r], r))
    out: list[tuple[ShardingType, list[TableShard]]] = []
    full = (0, t.num_embeddings, 0, t.embedding_dim)
    out.append((ShardingType.TABLE_WISE, [TableShard(t.name, order[0], *full)]))
    for k in (k for k in range(2, world + 1) if t.embedding_dim % k == 0 and world % k == 0):
        width = t.embedding_dim // k
        ranks = sorted(order[:k])
        out.append((ShardingType.COLUMN_WISE, [TableShard(t.name, r, 0, t.num_embeddings, i * width,
                                                          (i + 1) * width) for i, r in enumerate(ranks)]))
    if world > 1:
        rows = [b for b in balanced_rows(t.num_embeddings, world)]
        out.append((ShardingType.ROW_WISE, [TableShard(t.name, r, a, b, 0, t.embedding_dim)
                                            for r, (a, b) in enumerate(rows) if b > a]))
    if local > 1:  # one node (local == world): row-wise within it, as row_wise, which comes first on the tie
        node = min(range(world // local), key=lambda n: (sum(memory[n * local:(n + 1) * local]), n))
        rows = balanced_rows(t.num_embeddings, local)
        out.append((ShardingType.TABLE_ROW_WISE, [TableShard(t.name, node * local + i, a, b, 0, t.embedding_dim)
                                                  for i, (a, b) in enumerate(rows) if b > a]))
    out.append((ShardingType.DATA_PARALLEL, [TableShard(t.name, r, *full) for r in range(world)]))
    return out


def _comm_bytes(t: TableConfig, sharding: ShardingType, shards: list[TableShard], world: int,
                global_batch: int) -> float:
    """Bytes one step's lookups of ``t`` move between ranks: ids out, pooled rows back, their gradients out;
    for ``data_parallel`` none of these, but the bytes each rank sends in a ring all-reduce of the dense
    gradient of the whole table."""
    remote = (world - 1) / world
    if sharding is ShardingType.DATA_PARALLEL:
        return 2 * remote * t.elements * _VALUE_BYTES
    features = len(t.feature_names)
    ids = global_batch * features * t.ids_per_sample
    pooled = global_batch * features * t.embedding_dim * _VALUE_BYTES
    if sharding is ShardingType.COLUMN_WISE:  # every column block sees every id; the blocks add up to a row
        return remote * (len(shards) * ids * _ID_BYTES + 2 * pooled)
    # row blocks each return a partial sum of every sample's bag; one block (table-wise) returns the bag
    return remote * (ids * _ID_BYTES + 2 * len(shards) * pooled)


def _lookup_seconds(t: TableConfig, sharding: ShardingType, shards: list[TableShard], global_batch: int,
                    lookup_rate: float, shard_overhead: float) -> dict[int, float]:
    """Seconds each shard's rank spends on it per step: its row elements read (ids spread over row blocks
    in proportion to their rows; a replica reads only its own rank's samples' ids), plus a fixed cost
    per shard (kernels, bookkeeping)."""
    ids = global_batch * len(t.feature_names) * t.ids_per_sample
    if sharding is ShardingType.DATA_PARALLEL:
        ids /= len(shards)
    return {s.rank: ids * (s.rows / t.num_embeddings) * s.cols / lookup_rate + shard_overhead for s in shards}


def _sharding_types(value: object, what: str) -> tuple[ShardingType, ...]:
    """``value`` (a type, its name, or a non-empty list, tuple or set of them) as distinct types, in
    :class:`ShardingType` order; :class:`ConfigError` naming ``what`` otherwise."""
    items = [value] if isinstance(value, str) else value  # a ShardingType is a str
    if not isinstance(items, (list, tuple, set, frozenset)) or not items:
        raise ConfigError(f"{what} must be a sharding type or a non-empty list of them "
                          f"({[s.value for s in ShardingType]}), got {value!r}")
    kinds = set()
    for item in items:
        try:
            kinds.add(ShardingType(item))
        except ValueError:
            raise ConfigError(f"{what}: sharding must be one of {[s.value for s in ShardingType]}, "
                              f"got {item!r}") from None
    return tuple(k for k in ShardingType if k in kinds)


def _names(kinds: Iterable[ShardingType]) -> str:
    return " or ".join(k.value for k in kinds)


def _over(over_budget: Mapping[ShardingType, tuple[float, int, float, float]]) -> str:
    """What each type refused by the budget needs at least: ``kind needs X MiB on rank r (...)``."""
    return "; ".join(f"{kind.value} needs {_mib(total)} on rank {rank} ({_mib(own)} of this table, "
                     f"{_mib(taken)} already placed there)" for kind, (total, rank, own, taken) in over_budget.items())


def plan_tables(tables: Sequence[TableConfig], world_size: int, *, local_size: Optional[int] = None,
                global_batch: int = 1024, optimizer: str = "sgd", memory_per_rank: Optional[int] = None,
                bandwidth: float = 10e9, lookup_rate: float = 2e9, shard_overhead: float = 20e-6,
                constraints: Optional[Mapping[str, Constraint]] = None,
                sharding_types: Optional[Constraint] = None) -> EmbeddingPlan:
    """Place every table over ``world_size`` ranks; raise :class:`ConfigError` if one cannot fit.

    ``memory_per_rank`` (bytes of tables and optimizer state) defaults to 1.25x an even
    split of them all. ``bandwidth`` (bytes/s per rank), ``lookup_rate`` (row elements
    read per second) and ``shard_overhead`` (seconds per shard and step) weigh all-to-all
    and all-reduce volume against the busiest rank's lookups. ``constraints`` maps a table
    name to the sharding type it must take (a :class:`ShardingType` or its name) or to a list
    of the types it may take, of which the cheapest that fits is chosen; the memory budget
    still holds. ``sharding_types`` (default: all) are the types the caller's runtime runs,
    as a TorchRec sharder's: no table gets another, constrained or not.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    local = world_size if local_size is None else local_size
    if isinstance(local, bool) or not isinstance(local, int) or local < 1 or world_size % local:
        raise ConfigError(f"local_size must divide world_size {world_size}, got {local_size!r}")
    if optimizer not in OPTIMIZER_STATE_PER_ELEMENT:
        raise ConfigError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_PER_ELEMENT)}, got {optimizer!r}")
    tables = list(tables)
    if not tables:
        raise ConfigError("plan_tables needs at least one table")
    names = [t.name for t in tables]
    features = [f for t in tables for f in t.feature_names]
    if len(set(names)) != len(names) or len(set(features)) != len(features):
        raise ConfigError(f"table names and feature names must be unique; tables {names}, features {features}")
    runnable = tuple(ShardingType) if sharding_types is None else _sharding_types(sharding_types, "sharding_types")
    forced: dict[str, tuple[ShardingType, ...]] = {}
    for name, kind in (constraints or {}).items():
        if name not in names:
            raise ConfigError(f"constraint for unknown table {name!r}; tables: {names}")
        allowed = _sharding_types(kind, f"table {name!r}")
        forced[name] = tuple(k for k in allowed if k in runnable)
        if not forced[name]:
            raise ConfigError(f"table {name!r} is constrained to {_names(allowed)}, but this runtime runs only "
                              f"{_names(runnable)} (sharding_types)")
    total = sum(_table_bytes(t, t.elements, optimizer) for t in tables)
    budget = int(memory_per_rank if memory_per_rank is not None else 1.25 * total / world_size)
    memory, work = [0.0] * world_size, [0.0] * world_size
    # each rank's share of all lookups, were they spread evenly: a rank busier than the others only
    # costs time where it ends the step above that share (later tables fill the others up)
    even = sum(ids_load for t in tables for ids_load in _lookup_seconds(
        t, ShardingType.TABLE_WISE, [TableShard(t.name, 0, 0, t.num_embeddings, 0, t.embedding_dim)],
        global_batch, lookup_rate, shard_overhead).values()) / world_size
    placed: dict[str, TablePlacement] = {}
    for t in sorted(tables, key=lambda t: (-t.elements, t.name)):
        allowed = forced.get(t.name, runnable)
        best: Optional[tuple[float, ShardingType, list[TableShard], float, dict[int, float]]] = None
        notes: list[str] = []
        over_budget: dict[ShardingType, tuple[float, int, float, float]] = {}  # kind's least need
        options = [o for o in _options(t, world_size, local, memory, work) if o[0] in allowed]
        if not options:
            raise ConfigError(f"table {t.name!r} cannot be placed {_names(allowed)} on {world_size} ranks "
                              f"with {local} per node (row-wise needs 2 ranks or more, column-wise a width "
                              "that 2 or more of them divide, table-row-wise a node of 2 ranks or more)")
        for kind, shards in options:
            need = {s.rank: _table_bytes(t, s.rows * s.cols, optimizer) for s in shards}
            over = [r for r, b in need.items() if memory[r] + b > budget]
            if over:
                rank = max(over, key=lambda r: (memory[r] + need[r], -r))
                notes.append(f"{kind.value} needs {_mib(memory[rank] + need[rank])} on a rank")
                if kind not in over_budget or memory[rank] + need[rank] < over_budget[kind][0]:
                    over_budget[kind] = (memory[rank] + need[rank], rank, need[rank], memory[rank])
                continue
            comm = _comm_bytes(t, kind, shards, world_size, global_batch)
            load = _lookup_seconds(t, kind, shards, global_batch, lookup_rate, shard_overhead)
            # the step's extra work, shared by every rank, plus how much later the busiest rank finishes
            # than it would anyway (its even share, or the busiest so far)
            busiest = max(work[r] + load.get(r, 0.0) for r in range(world_size))
            cost = comm / bandwidth + sum(load.values()) / world_size + max(0.0, busiest - max(max(work), even))
            if best is None or cost < best[0]:
                best = (cost, kind, shards, comm, load)
        if best is None and t.name in forced:  # the types exist here, the budget refuses them
            impossible = [k for k in allowed if k not in {o[0] for o in options}]
            head = f"forced {_over(over_budget)}" if len(allowed) == 1 else \
                f"constrained to {_names(allowed)}: {_over(over_budget)}"
            if impossible:
                head += f" ({_names(impossible)} cannot exist on {world_size} ranks with {local} per node)"
            raise ConfigError(f"table {t.name!r} {head}, budget {_mib(budget)} per rank: the memory budget, not "
                              "the sharding type, is the problem: raise memory_per_rank or add ranks")
        if best is None:
            raise ConfigError(f"table {t.name!r} ({_mib(_table_bytes(t, t.elements, optimizer))} with {optimizer} "
                              f"state) fits no placement in {_mib(budget)} per rank: {_over(over_budget)}; "
                              "raise memory_per_rank or add ranks")
        cost, kind, shards, comm, load = best
        for s in shards:
            memory[s.rank] += _table_bytes(t, s.rows * s.cols, optimizer)
            work[s.rank] += load.get(s.rank, 0.0)
        if kind is ShardingType.DATA_PARALLEL:
            why = (f"replicated on all {world_size} ranks, no all-to-all: {sum(load.values()) * 1e3:.3f} ms of lookups "
                   f"(each rank its own samples), {comm / 1e6:.3f} MB per rank to all-reduce its dense gradient "
                   f"({comm / bandwidth * 1e3:.3f} ms): {cost * 1e3:.3f} ms/step, the lowest that fits")
        else:
            why = (f"{comm / 1e6:.3f} MB all-to-all ({comm / bandwidth * 1e3:.3f} ms) and "
                   f"{sum(load.values()) * 1e3:.3f} ms of lookups over {len(shards)} shard(s): "
                   f"{cost * 1e3:.3f} ms/step, the lowest that fits")
        if notes:
            why += " (over budget: " + "; ".join(notes) + ")"
        if t.name in forced:
            why = ("forced by constraints; " if len(allowed) == 1 else
                   f"the cheapest of {_names(allowed)} allowed by constraints; ") + why
        placed[t.name] = TablePlacement(t, kind, tuple(shards), int(comm), why)
    return EmbeddingPlan(world_size=world_size, local_size=local, placements=tuple(placed[n] for n in names),
                         optimizer=optimizer, memory_budget=budget, memory_per_rank=tuple(int(m) for m in memory))
