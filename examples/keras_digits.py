"""Data-parallel Keras 3 training on scikit-learn's digits, Horovod style (no download needed).

    mpirun -np 2 python examples/keras_digits.py                    # Keras on TensorFlow
    mpirun -np 2 python examples/keras_digits.py --backend torch    # Keras on PyTorch
    mpirun -np 2 python examples/keras_digits.py --backend jax      # Keras on JAX (compiled step)

``--backend`` sets ``KERAS_BACKEND`` before Keras is imported (an exported
``KERAS_BACKEND`` works too). The script is the same for every backend.

Each rank trains on its shard of the data; DistributedOptimizer averages the
gradients, the callbacks broadcast rank 0's initial weights, average the epoch
metrics and warm the (size-scaled) learning rate up. Rank 0 alone prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _backend_from_argv() -> None:
    """Apply ``--backend`` before Keras is imported: Keras reads ``KERAS_BACKEND`` once, at import."""
    for i, arg in enumerate(sys.argv):
        if arg == "--backend" and i + 1 < len(sys.argv):
            os.environ["KERAS_BACKEND"] = sys.argv[i + 1]
        elif arg.startswith("--backend="):
            os.environ["KERAS_BACKEND"] = arg.split("=", 1)[1]


_backend_from_argv()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import shardwise.keras as hvd  # noqa: E402


def limit_threads(threads: int) -> None:
    """Give each rank its share of the cores, in the running backend's own terms."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
    elif backend == "torch":
        import torch

        torch.set_num_threads(threads)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["tensorflow", "torch", "jax"], default=keras.backend.backend(),
                        help="Keras backend (default: KERAS_BACKEND, else tensorflow)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.001, help="single-process learning rate")
    parser.add_argument("--warmup-epochs", type=int, default=3)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init(monitor=True)  # times collectives vs compute; comm_fraction appears in the logs
    rank, size = hvd.rank(), hvd.size()
    limit_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=0,
                                                        stratify=digits.target)
    # Equal shards, so that every rank runs the same number of steps (each step is a collective).
    usable = len(x_train) // size * size
    x_shard, y_shard = x_train[rank:usable:size], y_train[rank:usable:size]

    keras.utils.set_random_seed(rank)  # different on purpose: the broadcast callback makes them equal
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    lr = args.lr * size  # linear scaling with the number of ranks
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(lr)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.CommMonitorCallback(),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              verbose=2 if rank == 0 else 0)

    # Each rank evaluates its share of the test set; sums over ranks give the global figures.
    x_part, y_part = x_test[rank::size], y_test[rank::size]
    loss, accuracy = model.evaluate(x_part, y_part, batch_size=256, verbose=0)
    totals = keras.ops.convert_to_numpy(hvd.allreduce(
        np.array([loss * len(x_part), accuracy * len(x_part), len(x_part)]), average=False))
    if rank == 0:
        print(f"final ({keras.backend.backend()}): loss={totals[0] / totals[2]:.4f} "
              f"test_accuracy={totals[1] / totals[2]:.3f}")
        # One machine-readable line for scripts and tests (the lines above are for people).
        print("SHARDWISE_RESULT " + json.dumps({"example": "keras_digits", "backend": keras.backend.backend(),
                                                "ranks": size, "epochs": args.epochs,
                                                "loss": float(totals[0] / totals[2]),
                                                "test_accuracy": float(totals[1] / totals[2]),
                                                "test_samples": int(totals[2])}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
