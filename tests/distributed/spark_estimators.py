"""Spark estimator scenarios on one ``local[2]`` SparkSession; one JSON verdict line per scenario.

Run by ``test_spark_estimator_mp.py`` (``python spark_estimators.py <store dir> [scenario ...]``).
Each scenario fits on scikit-learn's digits (every fifth row held out for ``transform``) with 2
ranks, then replays the fit in this one process: the training Parquet files that Spark wrote
into the store are read here with pyarrow, independently of ``shardwise.spark.data``, in the
order that module documents (files sorted by path, row groups by index; rank r takes groups
r, r+2, ...; the global batch of step s is rank 0's rows [s*B, (s+1)*B) then rank 1's), and the
one-process model trains on those global batches. The verdict gives the weights' largest
differences, the prediction column and the held-out accuracy.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "torch")  # the driver's Keras too: TensorFlow is never imported

import numpy as np

RANKS, BATCH, EPOCHS = 2, 16, 5


def verdict(name: str, **fields) -> None:
    print(json.dumps({"scenario": name, **fields}), flush=True)


def digits_frame(spark):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    rows = [(row.tolist(), int(t), i % 5 == 0, i % 5 == 1) for i, (row, t) in enumerate(zip(x, d.target))]
    df = spark.createDataFrame(rows, "features array<float>, label bigint, held_out boolean, is_val boolean")
    return df.filter("not held_out").drop("held_out"), df.filter("held_out").drop("held_out", "is_val")


def rank_rows(folder: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each rank's (features, labels) as the documented order gives them, read here with pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    groups = []
    for path in sorted(glob.glob(os.path.join(folder, "*.parquet"))):
        f = pq.ParquetFile(path)
        groups += [f.read_row_group(i) for i in range(f.num_row_groups)]
    out = []
    for r in range(RANKS):
        t = pa.concat_tables(groups[r::RANKS])
        x = np.array(t.column("features").to_pylist(), dtype=np.float32)
        out.append((x, np.array(t.column("label").to_pylist(), dtype=np.int64)))
    return out


def global_batches(folder: str) -> tuple[np.ndarray, np.ndarray, int]:
    """One epoch's rows in global-batch order (step s: rank 0's rows of s, then rank 1's), and the steps."""
    per_rank = rank_rows(folder)
    steps = min(len(x) // BATCH for x, _ in per_rank)
    xs, ys = [], []
    for s in range(steps):
        for x, y in per_rank:
            xs.append(x[s * BATCH:(s + 1) * BATCH])
            ys.append(y[s * BATCH:(s + 1) * BATCH])
    return np.concatenate(xs), np.concatenate(ys), steps


def differences(got: list[np.ndarray], want: list[np.ndarray]) -> dict:
    got = [np.asarray(g, np.float64) for g in got]
    want = [np.asarray(w, np.float64) for w in want]
    abs_diff = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
    rel_diff = max(float(np.max(np.abs(g - w) / np.maximum(np.abs(w), 1e-12))) for g, w in zip(got, want))
    # relative to each tensor's largest element: float32 rounding near zero is not a relative error
    tensor_rel = max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(got, want))
    close = all(np.allclose(g, w, rtol=1e-5, atol=1e-7) for g, w in zip(got, want))
    return {"max_abs_diff": abs_diff, "max_rel_diff": rel_diff, "max_rel_diff_per_tensor": tensor_rel,
            "allclose_rtol_1e-5_atol_1e-7": close}


def accuracy(pred_df, column: str) -> tuple[float, int]:
    pdf = pred_df.select("label", column).toPandas()
    pred = np.stack(pdf[column].to_numpy()).argmax(axis=1)
    return float((pred == pdf["label"].to_numpy()).mean()), len(pdf)


def checkpoints(store, run_id: str) -> list[str]:
    root = store.get_checkpoint_path(run_id)
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "*", "*")))


def torch_net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def torch_replay(initial: dict, folder: str) -> tuple[dict, int]:
    """The one-process model after EPOCHS epochs of SGD on the global batches of ``folder``; the steps per epoch."""
    import torch

    ref = torch_net()
    ref.load_state_dict(initial)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y, steps = global_batches(folder)
    g = RANKS * BATCH
    for _ in range(EPOCHS):
        for s in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(torch.from_numpy(x[s * g:(s + 1) * g])),
                                              torch.from_numpy(y[s * g:(s + 1) * g])).backward()
            opt.step()
    return ref.state_dict(), steps


def torch_fit(spark, store_dir: str, strategy, run_id: str, predict: bool) -> None:
    import torch

    from shardwise.spark.torch import TorchEstimator
    from shardwise.spark import Store

    train, test = digits_frame(spark)
    net = torch_net()
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    store = Store.create(store_dir)
    est = TorchEstimator(num_proc=RANKS, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                         loss=torch.nn.functional.cross_entropy, feature_cols=["features"], label_cols=["label"],
                         batch_size=BATCH, epochs=EPOCHS, validation=0.1, store=store, strategy=strategy,
                         shuffle=False, run_id=run_id, verbose=int(os.environ.get("SW_VERBOSE", "0")))
    start = time.time()
    fitted = est.fit(train)
    fit_s = time.time() - start
    want, steps = torch_replay(initial, store.get_train_data_path(run_id))
    got = fitted.getModel().state_dict()
    fields = dict(differences([got[k].numpy() for k in want], [want[k].numpy() for k in want]), steps_per_epoch=steps,
                  history=fitted.getHistory(), checkpoints=checkpoints(store, run_id), fit_seconds=fit_s)
    if predict:
        pred = fitted.transform(test)
        acc, rows = accuracy(pred, "label__output")
        fields.update(columns=pred.columns, accuracy=acc, held_out_rows=rows)
    verdict(run_id, **fields)


def torch_zero2(spark, store_dir: str) -> None:
    torch_fit(spark, store_dir, "zero2", "torch_zero2", predict=True)


def torch_layout_zero3(spark, store_dir: str) -> None:
    """A ParallelLayout strategy (parallelize's path), ZeRO-3: the gathered weights under the model's own names."""
    from shardwise.core.layout import ParallelLayout

    torch_fit(spark, store_dir, ParallelLayout(dp=RANKS, zero_stage=3), "torch_layout_zero3", predict=False)


def keras_dp(spark, store_dir: str) -> None:
    import keras

    from shardwise.spark.keras import KerasEstimator
    from shardwise.spark import Store

    train, test = digits_frame(spark)
    def build():  # seeded initializers: keras.utils.set_random_seed and to_json would import TensorFlow here
        init = keras.initializers.GlorotUniform
        return keras.Sequential([keras.Input((64,)),
                                 keras.layers.Dense(32, activation="tanh", kernel_initializer=init(1)),
                                 keras.layers.Dense(10, activation="softmax", kernel_initializer=init(2))])

    model = build()
    initial = model.get_weights()
    store = Store.create(store_dir)
    est = KerasEstimator(num_proc=RANKS, model=model, optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                         loss="sparse_categorical_crossentropy", feature_cols=["features"], label_cols=["label"],
                         batch_size=BATCH, epochs=EPOCHS, validation="is_val", store=store, strategy="dp",
                         shuffle=False, run_id="keras_dp", verbose=int(os.environ.get("SW_VERBOSE", "0")))
    start = time.time()
    fitted = est.fit(train)
    fit_s = time.time() - start

    ref = build()
    ref.set_weights(initial)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy")
    x, y, steps = global_batches(store.get_train_data_path("keras_dp"))
    ref.fit(x, y, batch_size=RANKS * BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    pred = fitted.transform(test)
    acc, rows = accuracy(pred, "label__output")
    verdict("keras_dp", **differences(fitted.getWeights(), ref.get_weights()), steps_per_epoch=steps,
            columns=pred.columns, accuracy=acc, held_out_rows=rows, history=fitted.getHistory(),
            checkpoints=checkpoints(store, "keras_dp"), fit_seconds=fit_s)


def bad_input(spark, store_dir: str) -> None:
    import torch

    from shardwise.core.errors import ConfigError
    from shardwise.spark.torch import TorchEstimator
    from shardwise.spark import Store

    train, _ = digits_frame(spark)
    net = torch.nn.Linear(64, 10)
    common = dict(num_proc=RANKS, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                  loss=torch.nn.functional.cross_entropy, label_cols=["label"], store=Store.create(store_dir))
    messages = {}
    for case, make in {
        "unknown_strategy": lambda: TorchEstimator(feature_cols=["features"], strategy="zero4", **common),
        "missing_column": lambda: TorchEstimator(feature_cols=["pixels"], **common).fit(train),
        "batch_size": lambda: TorchEstimator(feature_cols=["features"], batch_size=0, **common),
        "no_feature_cols": lambda: TorchEstimator(**common),
    }.items():
        try:
            make()
            messages[case] = None
        except ConfigError as exc:
            messages[case] = f"ConfigError: {exc}"
        except Exception as exc:  # noqa: BLE001 - the verdict says what was raised instead
            messages[case] = f"{type(exc).__name__}: {exc}"
    verdict("bad_input", messages=messages)


SCENARIOS = {"torch_zero2": torch_zero2, "torch_layout_zero3": torch_layout_zero3, "keras_dp": keras_dp,
             "bad_input": bad_input}


def main() -> None:
    from pyspark.sql import SparkSession

    store_dir, names = sys.argv[1], sys.argv[2:] or list(SCENARIOS)
    spark = (SparkSession.builder.master(f"local[{RANKS}]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        for name in names:
            start = time.time()
            try:
                SCENARIOS[name](spark, os.path.join(store_dir, name))
            except Exception:  # noqa: BLE001 - reported as the scenario's verdict
                verdict(name, error=traceback.format_exc())
            print(f"scenario {name}: {time.time() - start:.1f} s", file=sys.stderr, flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
