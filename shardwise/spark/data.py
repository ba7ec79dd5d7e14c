"""A DataFrame to Parquet in the store (Spark), and each rank's share of it (pyarrow only).

Writing (driver, :func:`prepare_data`): the feature and label columns are selected and
converted - a Spark ML vector or a numeric array becomes a fixed-size ``array<float>``, a
numeric scalar feature a ``float``, an integral label stays ``bigint`` (class indices), a
fractional label becomes ``float``; rows are split into training and validation
(``validation``: a fraction, or the name of a boolean/integer column that marks validation
rows), and each part is written by Spark (``df.write.parquet``) in ``num_files`` files.

Reading (workers, :func:`read_rank`; each rank holds its rows in memory as numpy arrays) - the
exact order, so that a one-process reference can replay a run:

1. The *row groups* of a Parquet folder are its ``*.parquet`` files sorted by path, and each
   file's row groups by index: ``g_0, g_1, ...``.
2. Rank ``r`` of ``N`` takes groups ``g_r, g_{r+N}, g_{r+2N}, ...`` and concatenates their rows in
   that order: its *local rows* ``0 .. n_r - 1``.
3. Every rank runs ``steps = min over ranks of n_r // batch_size`` steps per epoch
   (:func:`steps_per_epoch`, agreed across ranks, so no rank waits for another's extra step);
   the rows a rank leaves over are not used in that epoch.
4. In epoch ``e``, rank ``r`` visits its local rows in the order :func:`epoch_order` gives: ``0, 1,
   ..., n_r - 1`` without shuffle; with ``shuffle`` a permutation drawn by
   ``numpy.random.default_rng([seed, e, r])``.
5. Step ``s`` of rank ``r`` takes the rows at positions ``[s*B, (s+1)*B)`` of that order; the *global
   batch* of step ``s`` is the concatenation over ranks ``0 .. N-1`` of those rows, and data-parallel
   training averages the ranks' gradients, i.e. it trains on the mean loss of the global batch.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np

from shardwise.core.errors import ConfigError

from .store import Store

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame


@dataclass(frozen=True)
class ColumnSpec:
    """One column as written: its name, per-row shape (``()`` for a scalar) and numpy dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class DataInfo:
    """What :func:`prepare_data` wrote: the Parquet folders, their row counts and the columns."""

    train_path: str
    val_path: Optional[str]
    train_rows: int
    val_rows: int
    features: tuple[ColumnSpec, ...]
    labels: tuple[ColumnSpec, ...] = field(default=())

    @property
    def columns(self) -> tuple[ColumnSpec, ...]:
        return self.features + self.labels


# -- writing (driver) ------------------------------------------------------------------------------------
def check_columns(df: "DataFrame", columns: Sequence[str], what: str) -> None:
    """ConfigError naming the columns of ``columns`` that ``df`` lacks, and those it has."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ConfigError(f"{what} {missing} not in the DataFrame; its columns are {list(df.columns)}")


def _convert(df: "DataFrame", name: str, is_label: bool) -> tuple[Any, str]:
    """The Spark expression that writes column ``name``, and its numpy dtype."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    dtype = df.schema[name].dataType
    col = F.col(name)
    if isinstance(dtype, VectorUDT):
        return vector_to_array(col, "float32").alias(name), "float32"
    if isinstance(dtype, T.ArrayType):
        if not isinstance(dtype.elementType, T.NumericType):
            raise ConfigError(f"column {name!r} is an array of {dtype.elementType.simpleString()}; "
                              f"only arrays of numbers (or ML vectors) can be trained on")
        return col.cast("array<float>").alias(name), "float32"
    if isinstance(dtype, (T.BooleanType, T.NumericType)):
        if is_label and isinstance(dtype, (T.BooleanType, T.IntegralType)):
            return col.cast("bigint").alias(name), "int64"
        return col.cast("float").alias(name), "float32"
    raise ConfigError(f"column {name!r} has type {dtype.simpleString()}; a feature or label column must be a "
                      f"number, an array of numbers or an ML vector")


def _validation_split(df: "DataFrame", validation: Union[float, str, None], seed: int) -> tuple[Any, Any, Any]:
    """(training rows, validation rows or None, the DataFrame persisted for the split or None)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if validation is None or validation == 0:
        return df, None, None
    if isinstance(validation, str):
        check_columns(df, [validation], "validation column")
        dtype = df.schema[validation].dataType
        if not isinstance(dtype, (T.BooleanType, T.IntegralType)):
            raise ConfigError(f"validation column {validation!r} has type {dtype.simpleString()}; it must be "
                              f"boolean or integer (true / non-zero marks a validation row)")
        mark = F.col(validation).cast("boolean")
        return df.filter(~mark), df.filter(mark), None
    # persisted: the two writes must see one draw (rand is recomputed if the rows are)
    marked = df.withColumn("__shardwise_val", F.rand(seed) < float(validation)).persist()
    train = marked.filter(~F.col("__shardwise_val")).drop("__shardwise_val")
    val = marked.filter(F.col("__shardwise_val")).drop("__shardwise_val")
    return train, val, marked


def _row_counts(store: Store, path: str) -> int:
    return sum(n for _, _, n in row_groups(store, path))


def _check_rows(train_df: "DataFrame", names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """One pass over the training rows: some rows, no nulls, one size per array column; the per-row shapes."""
    from pyspark.sql import functions as F

    arrays = [n for n in names if dict(train_df.dtypes)[n].startswith("array")]
    aggs = [F.count(F.lit(1)).alias("rows")]
    aggs += [F.sum(F.col(n).isNull().cast("int")).alias(f"nulls_{i}") for i, n in enumerate(names)]
    for i, n in enumerate(arrays):
        aggs += [F.min(F.size(n)).alias(f"min_{i}"), F.max(F.size(n)).alias(f"max_{i}")]
    stats = train_df.agg(*aggs).collect()[0]
    if not stats["rows"]:
        raise ConfigError("the training data has no rows (after the validation rows were split off)")
    for i, n in enumerate(names):
        if stats[f"nulls_{i}"]:
            raise ConfigError(f"column {n!r} has {stats[f'nulls_{i}']} null value(s); drop or fill them first")
    shapes: dict[str, tuple[int, ...]] = {n: () for n in names}
    for i, n in enumerate(arrays):
        lo, hi = stats[f"min_{i}"], stats[f"max_{i}"]
        if lo != hi:
            raise ConfigError(f"column {n!r} holds arrays of {lo} to {hi} elements; each row must have the same size")
        shapes[n] = (int(lo),)
    return shapes


def prepare_data(df: "DataFrame", store: Store, feature_cols: Sequence[str], label_cols: Sequence[str], *,
                 validation: Union[float, str, None] = None, num_files: int = 1, seed: int = 0,
                 idx: Any = None) -> DataInfo:
    """Write ``df``'s feature and label columns to ``store`` as Parquet (Spark), split off the validation rows.

    ``validation``: a fraction in (0, 1) of rows drawn by ``rand(seed)`` (deterministic for one
    seed and one partitioning of ``df``), or a boolean/integer column whose true/non-zero rows
    are the validation rows. ``num_files``: files per part (use a multiple of the number of
    ranks, so that every rank gets row groups). Array and vector columns must have one size
    on every row. Overwrites the store's data folders of ``idx``.
    """
    check_columns(df, list(feature_cols) + list(label_cols), "columns")
    names = list(dict.fromkeys(list(feature_cols) + list(label_cols)))
    train_df, val_df, cached = _validation_split(df, validation, seed)
    try:
        converted = {n: _convert(df, n, n in label_cols and n not in feature_cols) for n in names}
        exprs = [converted[n][0] for n in names]
        train_df = train_df.select(*exprs)
        shapes = _check_rows(train_df, names)
        train_path = store.get_train_data_path(idx)
        train_df.repartition(num_files).write.mode("overwrite").parquet(store.spark_path(train_path))
        val_path, val_rows = None, 0
        if val_df is not None:
            val_path = store.get_val_data_path(idx)
            val_df.select(*exprs).repartition(num_files).write.mode("overwrite").parquet(store.spark_path(val_path))
            val_rows = _row_counts(store, val_path)
    finally:
        if cached is not None:
            cached.unpersist()

    def spec(n: str) -> ColumnSpec:
        return ColumnSpec(n, shapes[n], converted[n][1])

    return DataInfo(train_path=train_path, val_path=val_path, train_rows=_row_counts(store, train_path),
                    val_rows=val_rows, features=tuple(spec(n) for n in feature_cols),
                    labels=tuple(spec(n) for n in label_cols))


# -- reading (workers) -----------------------------------------------------------------------------------
def row_groups(store: Store, path: str) -> list[tuple[str, int, int]]:
    """``(file, index, rows)`` of every row group of the Parquet folder ``path``, in the documented order."""
    import pyarrow.parquet as pq

    out = []
    for f in store.list_files(path):
        if not posixpath.basename(f).endswith(".parquet"):
            continue  # _SUCCESS, .crc files
        with store.open(f) as fh:
            meta = pq.ParquetFile(fh).metadata
            out += [(f, i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)]
    return out


def _to_numpy(column: Any, spec: ColumnSpec) -> np.ndarray:
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(column)
    values = column.flatten() if spec.shape else column
    # a writable copy (Arrow's buffers are read-only, torch.from_numpy warns on them)
    return np.array(values.to_numpy(zero_copy_only=False), dtype=spec.dtype).reshape((n,) + spec.shape)


def read_rank(store: Store, path: str, rank: int, size: int, columns: Sequence[ColumnSpec]) -> dict[str, np.ndarray]:
    """Rank ``rank`` of ``size``'s local rows of folder ``path``: its row groups ``rank, rank + size, ...``,
    concatenated, as one numpy array per column (``rows x shape``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = [c.name for c in columns]
    tables = []
    for f, i, _ in row_groups(store, path)[rank::size]:
        with store.open(f) as fh:
            tables.append(pq.ParquetFile(fh).read_row_group(i, columns=names))
    if not tables:
        return {c.name: np.zeros((0,) + c.shape, c.dtype) for c in columns}
    table = pa.concat_tables(tables)
    return {c.name: _to_numpy(table.column(c.name), c) for c in columns}


def epoch_order(rows: int, epoch: int, rank: int, shuffle: bool, seed: int) -> np.ndarray:
    """The order in which rank ``rank`` visits its ``rows`` local rows in epoch ``epoch``."""
    if not shuffle:
        return np.arange(rows)
    return np.random.default_rng([seed, epoch, rank]).permutation(rows)


def steps_per_epoch(rows: int, batch_size: int, comm: Any) -> int:
    """``min over ranks of rows // batch_size`` (collective over ``comm``, a shardwise Communicator)."""
    steps = min(int(s) for s in comm.allgather_object(rows // batch_size))
    if steps < 1:
        counts = comm.allgather_object(rows)
        raise ConfigError(f"a rank has fewer rows than one batch of {batch_size} (rows per rank: {counts}); "
                          f"lower batch_size or write more rows")
    return steps
