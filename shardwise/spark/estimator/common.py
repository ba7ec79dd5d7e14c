"""What the torch and Keras Spark estimators share: parameters and their checks, the fit driver,
each rank's data, and the fitted Spark ``Model`` (a Transformer) base.

The parameter names are Horovod's (``horovod.spark.common.params.EstimatorParams``): ``num_proc``,
``model``, ``optimizer``, ``loss``, ``feature_cols``, ``label_cols``, ``batch_size``,
``val_batch_size``, ``epochs``, ``validation``, ``store``, ``run_id``, ``shuffle``,
``random_seed``, ``verbose``, ``partitions_per_process``; shardwise adds ``strategy`` and
``backend``.
"""

from __future__ import annotations

import time
import uuid
from types import MappingProxyType
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
from pyspark.ml import Estimator, Model

from shardwise.core.errors import ConfigError

from ..data import ColumnSpec, DataInfo, epoch_order, prepare_data, read_rank, steps_per_epoch
from ..store import Store

ZERO_STAGES = MappingProxyType({"zero1": 1, "zero2": 2, "zero3": 3})


@dataclass(frozen=True)
class EstimatorParams:
    """The checked parameters of a fit (see the estimators' docstrings for each one)."""

    num_proc: Optional[int]
    feature_cols: tuple[str, ...]
    label_cols: tuple[str, ...]
    store: Store
    batch_size: int = 32
    val_batch_size: Optional[int] = None
    epochs: int = 1
    validation: Union[float, str, None] = None
    strategy: Any = "dp"
    run_id: Optional[str] = None
    shuffle: bool = True
    random_seed: int = 0
    verbose: int = 1
    partitions_per_process: int = 1
    output_cols: Optional[tuple[str, ...]] = None
    backend: str = "gloo"

    def __post_init__(self) -> None:
        def positive_int(name: str, value: Any, optional: bool = False) -> None:
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")

        positive_int("num_proc", self.num_proc, optional=True)
        positive_int("batch_size", self.batch_size)
        positive_int("val_batch_size", self.val_batch_size, optional=True)
        positive_int("epochs", self.epochs)
        positive_int("partitions_per_process", self.partitions_per_process)
        for name in ("feature_cols", "label_cols"):
            cols = getattr(self, name)
            if not cols or not all(isinstance(c, str) and c for c in cols):
                raise ConfigError(f"{name} must name at least one column (a list of strings), got {list(cols)!r}")
        if not isinstance(self.store, Store):
            raise ConfigError(f"store must be a shardwise.spark.store.Store (Store.create(path)), got "
                              f"{type(self.store).__name__}")
        v = self.validation
        if not (v is None or (isinstance(v, str) and v) or
                (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1)):
            raise ConfigError(f"validation must be a fraction in [0, 1) or the name of a boolean/integer column, "
                              f"got {v!r}")
        if self.output_cols is not None and len(self.output_cols) != len(self.label_cols):
            raise ConfigError(f"output_cols {list(self.output_cols)} must name one column per label column "
                              f"{list(self.label_cols)}")
        from ..runner import BACKENDS

        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; shardwise.spark.run knows {sorted(BACKENDS)}")
        if self.run_id is not None and (not isinstance(self.run_id, str) or "/" in self.run_id or not self.run_id):
            raise ConfigError(f"run_id must be a non-empty string without '/', got {self.run_id!r}")

    def outputs(self) -> tuple[str, ...]:
        """The prediction columns: ``output_cols``, or ``<label>__output`` per label as Horovod names them."""
        return self.output_cols or tuple(f"{c}__output" for c in self.label_cols)


def as_columns(value: Any, name: str) -> tuple[str, ...]:
    """A column list parameter as a tuple (a single string is one column)."""
    if value is None:
        raise ConfigError(f"{name} is required: the DataFrame columns to train on")
    return (value,) if isinstance(value, str) else tuple(value)


def zero_stage(strategy: Any, allowed: Sequence[str]) -> Optional[int]:
    """0 for ``"dp"``, 1-3 for ``"zeroN"``, None for anything else that is not a string; ConfigError for an
    unknown name."""
    if isinstance(strategy, str):
        if strategy not in allowed:
            raise ConfigError(f"unknown strategy {strategy!r}; expected one of {list(allowed)}")
        return 0 if strategy == "dp" else ZERO_STAGES[strategy]
    return None


@dataclass(frozen=True)
class TrainSpec:
    """What every worker receives: the data written, where to checkpoint, and how to loop."""

    data: DataInfo
    store: Store
    run_id: str
    batch_size: int
    val_batch_size: int
    epochs: int
    shuffle: bool
    seed: int
    verbose: int
    strategy: Any
    payload: Any  # the framework's model / optimizer / loss, as the estimator ships them


class ShardwiseEstimator(Estimator):
    """A Spark ML ``Estimator`` that trains on ``num_proc`` Spark barrier tasks with shardwise.

    Subclasses give :meth:`_payload` (what the workers need to rebuild the model), :meth:`_train_fn`
    (the function each rank runs), :meth:`_env` and :meth:`_make_model`.
    """

    def __init__(self, params: EstimatorParams) -> None:
        super().__init__()
        self._est = params

    # -- subclass hooks ------------------------------------------------------------------------------------
    def _payload(self) -> Any:
        raise NotImplementedError

    def _train_fn(self) -> Callable[[TrainSpec], Any]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return {}

    def _make_model(self, result: dict, spec: TrainSpec) -> "ShardwiseModel":
        raise NotImplementedError

    # -- Horovod's getters ----------------------------------------------------------------------------------
    def getStore(self) -> Store:
        return self._est.store

    def getBatchSize(self) -> int:
        return self._est.batch_size

    def getEpochs(self) -> int:
        return self._est.epochs

    def getFeatureCols(self) -> list[str]:
        return list(self._est.feature_cols)

    def getLabelCols(self) -> list[str]:
        return list(self._est.label_cols)

    def getStrategy(self) -> Any:
        return self._est.strategy

    # -- fit --------------------------------------------------------------------------------------------------
    def _fit(self, dataset: Any) -> "ShardwiseModel":
        from shardwise import spark as sw_spark

        p, started = self._est, time.time()
        run_id = p.run_id or f"run_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}"
        num_proc = p.num_proc or dataset.sparkSession.sparkContext.defaultParallelism
        info = prepare_data(dataset, p.store, p.feature_cols, p.label_cols, validation=p.validation,
                            num_files=num_proc * p.partitions_per_process, seed=p.random_seed, idx=run_id)
        spec = TrainSpec(data=info, store=p.store, run_id=run_id, batch_size=p.batch_size,
                         val_batch_size=p.val_batch_size or p.batch_size, epochs=p.epochs, shuffle=p.shuffle,
                         seed=p.random_seed, verbose=p.verbose, strategy=p.strategy, payload=self._payload())
        written = time.time()
        if p.verbose:
            print(f"[shardwise.spark {run_id}] {info.train_rows} training and {info.val_rows} validation rows "
                  f"written to {p.store} ({written - started:.1f} s)", flush=True)
        results = sw_spark.run(self._train_fn(), args=(spec,), num_proc=num_proc, env=self._env(),
                               backend=p.backend, verbose=p.verbose)
        if p.verbose:
            print(f"[shardwise.spark {run_id}] trained on {num_proc} processes ({time.time() - written:.1f} s)",
                  flush=True)
        return self._make_model(results[0], spec)


# -- on the workers --------------------------------------------------------------------------------------
@dataclass
class RankData:
    """One rank's rows (features and labels, numpy), its validation rows, and the agreed step counts."""

    features: list[np.ndarray]
    labels: list[np.ndarray]
    val_features: list[np.ndarray]
    val_labels: list[np.ndarray]
    steps: int
    val_steps: int

    @staticmethod
    def load(spec: TrainSpec, rank: int, size: int, comm: Any) -> "RankData":
        """Read this rank's row groups (collective: the step counts are agreed over ``comm``)."""
        info = spec.data
        train = read_rank(spec.store, info.train_path, rank, size, info.columns)
        val = (read_rank(spec.store, info.val_path, rank, size, info.columns) if info.val_path
               else {c.name: np.zeros((0,) + c.shape, c.dtype) for c in info.columns})
        rows = len(train[info.features[0].name])
        steps = steps_per_epoch(rows, spec.batch_size, comm)
        val_rows = len(val[info.features[0].name])
        # every rank runs as many evaluation batches as the rank with the most (collective models)
        val_steps = max(int(n) for n in comm.allgather_object(-(-val_rows // spec.val_batch_size)))
        return RankData([train[c.name] for c in info.features], [train[c.name] for c in info.labels],
                        [val[c.name] for c in info.features], [val[c.name] for c in info.labels], steps, val_steps)

    def epoch_batches(self, spec: TrainSpec, epoch: int, rank: int) -> Iterator[tuple[list, list]]:
        """This rank's ``steps`` batches of epoch ``epoch`` (features, labels), in the documented order."""
        order = epoch_order(len(self.features[0]), epoch, rank, spec.shuffle, spec.seed)
        b = spec.batch_size
        for s in range(self.steps):
            idx = order[s * b:(s + 1) * b]
            yield [f[idx] for f in self.features], [y[idx] for y in self.labels]

    def epoch_rows(self, spec: TrainSpec, epoch: int, rank: int) -> tuple[list, list]:
        """All rows of the epoch's batches, in order (``steps * batch_size`` rows)."""
        order = epoch_order(len(self.features[0]), epoch, rank, spec.shuffle, spec.seed)
        idx = order[:self.steps * spec.batch_size]
        return [f[idx] for f in self.features], [y[idx] for y in self.labels]

    def val_batches(self, spec: TrainSpec) -> Iterator[tuple[list, list, int]]:
        """``val_steps`` batches (features, labels, real rows); a rank out of rows gets one padding row, count 0."""
        b = spec.val_batch_size
        for s in range(self.val_steps):
            feats = [f[s * b:(s + 1) * b] for f in self.val_features]
            labels = [y[s * b:(s + 1) * b] for y in self.val_labels]
            n = len(feats[0])
            if n == 0:
                feats = [np.zeros((1,) + f.shape[1:], f.dtype) for f in self.val_features]
                labels = [np.zeros((1,) + y.shape[1:], y.dtype) for y in self.val_labels]
            yield feats, labels, n


def mean_over_ranks(total: float, count: int, comm: Any) -> float:
    """sum(total) / sum(count) over the ranks of ``comm`` (NaN when no rank counted anything)."""
    pairs = comm.allgather_object((float(total), int(count)))
    n = sum(c for _, c in pairs)
    return sum(t for t, _ in pairs) / n if n else float("nan")


def log(spec: TrainSpec, rank: int, message: str) -> None:
    """Print ``message`` on rank 0 when the fit is verbose."""
    if spec.verbose and rank == 0:
        print(f"[shardwise.spark {spec.run_id}] {message}", flush=True)


# -- the fitted model --------------------------------------------------------------------------------------
def _spark_type(shape: tuple[int, ...]) -> Any:
    from pyspark.sql import types as T

    return T.DoubleType() if not shape else T.ArrayType(T.DoubleType(), containsNull=False)


def _dense(value: Any, spec: ColumnSpec) -> np.ndarray:
    """One row's array: a list/array, an ML vector, or the struct Arrow gives for a vector
    (``{"type": 1, "values": ...}`` dense, ``{"type": 0, "size", "indices", "values"}`` sparse)."""
    if hasattr(value, "toArray"):
        value = value.toArray()
    elif isinstance(value, dict):
        if value.get("type") == 0:
            dense = np.zeros(int(value["size"]), spec.dtype)
            dense[np.asarray(value["indices"], dtype=np.int64)] = value["values"]
            value = dense
        else:
            value = value["values"]
    return np.asarray(value, dtype=spec.dtype)


def pandas_features(pdf: Any, specs: Sequence[ColumnSpec]) -> list[np.ndarray]:
    """The feature columns of a pandas batch as numpy arrays (``rows x shape``, the dtype written for training)."""
    out = []
    for c in specs:
        col = pdf[c.name].to_numpy()
        if c.shape:
            arr = (np.stack([_dense(v, c) for v in col]) if len(col) else np.zeros((0,) + c.shape, c.dtype))
            out.append(arr.reshape((len(col),) + c.shape))
        else:
            out.append(col.astype(c.dtype))
    return out


def pandas_outputs(outputs: Sequence[np.ndarray]) -> list[Any]:
    """Each output (rows x ...) as a pandas column: floats for per-row scalars, lists for arrays."""
    cols = []
    for out in outputs:
        out = np.asarray(out, dtype=np.float64)
        if out.ndim == 1:
            cols.append(out)
        else:
            cols.append(list(out.reshape(len(out), -1)))
    return cols


class ShardwiseModel(Model):
    """A fitted estimator: a Spark ML ``Model`` whose :meth:`transform` adds the prediction columns.

    Prediction runs on the executors with ``mapInPandas`` (batches of ``batch_size`` rows, the
    framework on CPU), from the serialized model this object holds. The executors' Python is the
    SparkContext's (``PYSPARK_PYTHON``); it must import the framework.
    """

    def __init__(self, *, history: dict[str, list[float]], features: Sequence[ColumnSpec],
                 label_cols: Sequence[str], output_cols: Sequence[str], output_shapes: Sequence[tuple[int, ...]],
                 run_id: str, batch_size: int = 256) -> None:
        super().__init__()
        self._history = history
        self._features = tuple(features)
        self._label_cols = tuple(label_cols)
        self._output_cols = tuple(output_cols)
        self._output_shapes = tuple(tuple(s) for s in output_shapes)
        self._run_id = run_id
        self._batch_size = batch_size

    def getHistory(self) -> dict[str, list[float]]:
        """Per-epoch ``loss`` (and ``val_loss`` with validation rows), averaged over the ranks."""
        return self._history

    def getRunId(self) -> str:
        return self._run_id

    def getFeatureColumns(self) -> list[str]:
        return [c.name for c in self._features]

    def getLabelColumns(self) -> list[str]:
        return list(self._label_cols)

    def getOutputCols(self) -> list[str]:
        return list(self._output_cols)

    def setOutputCols(self, cols: Sequence[str]) -> "ShardwiseModel":
        if len(cols) != len(self._output_cols):
            raise ConfigError(f"setOutputCols needs {len(self._output_cols)} names (one per output), got {list(cols)}")
        self._output_cols = tuple(cols)
        return self

    def _predict_fn(self) -> Callable[[Iterator[Any]], Iterator[Any]]:
        """A picklable function from an iterator of pandas batches to the same batches with the outputs added."""
        raise NotImplementedError

    def _transform(self, dataset: Any) -> Any:
        from pyspark.sql import types as T

        from ..data import check_columns

        check_columns(dataset, [c.name for c in self._features], "feature columns")
        clash = [c for c in self._output_cols if c in dataset.columns]
        if clash:
            raise ConfigError(f"output columns {clash} already exist in the DataFrame; pick others with output_cols")
        schema = T.StructType(list(dataset.schema.fields) +
                              [T.StructField(c, _spark_type(s), False)
                               for c, s in zip(self._output_cols, self._output_shapes)])
        from pyspark.ml.linalg import VectorUDT

        from ..runner import worker_python

        predict = self._predict_fn()
        vectors = [f.name for f in dataset.schema.fields if isinstance(f.dataType, VectorUDT)]
        if vectors:
            predict = _vectors_back(predict, vectors)
        with worker_python(dataset.sparkSession.sparkContext):  # the UDF's Python is fixed when it is made
            return dataset.mapInPandas(predict, schema)


def _vectors_back(predict: Callable[[Iterator[Any]], Iterator[Any]],
                  columns: Sequence[str]) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """``predict`` whose batches give ML vectors back for ``columns``: Arrow hands a vector column to pandas
    as dicts, which Spark does not take back."""

    def to_vector(value: Any) -> Any:
        from pyspark.ml.linalg import DenseVector, SparseVector

        if not isinstance(value, dict):
            return value
        if value.get("type") == 0:
            return SparseVector(int(value["size"]), list(value["indices"]), list(value["values"]))
        return DenseVector(value["values"])

    def wrapped(batches: Iterator[Any]) -> Iterator[Any]:
        for pdf in predict(batches):
            for c in columns:
                pdf[c] = [to_vector(v) for v in pdf[c]]
            yield pdf

    return wrapped
