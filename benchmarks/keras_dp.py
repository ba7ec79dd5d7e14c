"""Keras 3 data-parallel training speed: shardwise ``model.fit`` vs MultiWorkerMirroredStrategy.

Run on 2 ranks:  mpirun -np 2 python benchmarks/keras_dp.py   (or: shardwise run -np 2 -- ...)

Both contenders train the same Keras 3 MLP (about 6.3M parameters) from the same
initial weights on the same per-worker data, in the same processes:

* shardwise: ``model.fit`` with ``shardwise.keras.DistributedOptimizer`` (mpi
  backend; gradients fused into buckets, one MPI allreduce per bucket);
* MWMS: ``tf.distribute.MultiWorkerMirroredStrategy`` (TF_CONFIG derived from the
  MPI ranks by ``shardwise.tensorflow.strategy()``) with a ``strategy.run`` custom
  training loop. Keras 3 ``model.fit`` under MWMS fails on multi-worker CPU
  (keras-team/keras#20585), hence the custom loop, which is also MWMS's fastest path.

Rounds alternate which contender goes first so machine noise hits both alike;
each round times ``--steps`` steps after warm-up, the slowest rank's time counts,
and the table shows the median over rounds. Both end with identical weights on
every rank (checked), so both really train data-parallel.

Both read the same tf.data pipeline (fixed prefetch, autotuning off: with it on,
deleting the iterator at the end of a ``fit`` call often waited ~1.2 s for tf.data's
autotune thread on 2 busy workers, a per-call cost real epochs amortise but 20-step
rounds would not; MWMS's loop keeps one iterator and never paid it).

OpenMPI busy-polls while a rank waits in a collective, which steals the CPU from
the peer's compute when ranks share cores (2 workers on a small or busy host).
The script sets ``OMPI_MCA_mpi_yield_when_idle=1`` (OpenMPI's own advice for
oversubscribed nodes) unless the variable is already set; MWMS's gRPC waits
block anyway. Pass ``OMPI_MCA_mpi_yield_when_idle=0`` to measure without it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")  # read at MPI_Init, i.e. the mpi4py import

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import shardwise  # noqa: E402

WIDTHS = (1024, 2048, 2048)
CLASSES = 10


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="samples per worker per step")
    parser.add_argument("--threads", type=int, default=1, help="TF intra-op threads per worker")
    return parser.parse_args()


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((WIDTHS[0],))]
    layers += [keras.layers.Dense(w, activation="relu") for w in WIDTHS[1:]]
    layers += [keras.layers.Dense(CLASSES)]
    return keras.Sequential(layers)


def worker_data(rank: int, size: int, batch: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """This worker's rows of one global dataset (every size-th row, as shardwise.tensorflow.shard)."""
    rng = np.random.default_rng(0)
    n = size * batch * steps
    x = rng.normal(size=(n, WIDTHS[0])).astype("float32")
    y = rng.integers(0, CLASSES, size=n).astype("int32")
    return x[rank::size], y[rank::size]


def slowest(seconds: float) -> float:
    return MPI.COMM_WORLD.allreduce(seconds, op=MPI.MAX)


def timed(run: Callable[[], None]) -> float:
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    run()
    return slowest(time.perf_counter() - t0)


def check_synchronized(weights: list[np.ndarray], what: str) -> None:
    digest = np.array([float(np.sum(w, dtype=np.float64)) for w in weights])
    every = MPI.COMM_WORLD.allgather(digest)
    if any(not np.array_equal(every[0], d) for d in every[1:]):
        raise SystemExit(f"{what}: weights differ across ranks after training")


def main() -> None:
    args = parse()
    comm = shardwise.init(backend="mpi").world
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    import shardwise.keras as hvd
    import shardwise.tensorflow as hvd_tf

    strategy = hvd_tf.strategy()  # before other TF work: MWMS must configure the runtime
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), type(strategy)
    size, rank, b = comm.size, comm.rank, args.batch
    x, y = worker_data(rank, size, b, args.steps)

    def make_dataset(_: object = None) -> tf.data.Dataset:
        options = tf.data.Options()
        options.autotune.enabled = False  # its thread stalls iterator teardown ~1 s (see the docstring)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(b, drop_remainder=True).prefetch(4)
        return ds.with_options(options)

    dataset = make_dataset()

    # -- shardwise: model.fit + DistributedOptimizer -------------------------------------------
    sw_model = build_model()
    init_weights = sw_model.get_weights()
    sw_model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    hvd.broadcast_variables(sw_model.variables, root_rank=0)

    def run_shardwise(steps: int) -> None:
        sw_model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)

    # -- MWMS: strategy.run custom loop --------------------------------------------------------------
    with strategy.scope():
        mw_model = build_model()
        mw_model.set_weights(init_weights)
        mw_opt = keras.optimizers.SGD(0.01)
        mw_opt.build(mw_model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    global_batch = b * size
    mw_iter = iter(strategy.distribute_datasets_from_function(make_dataset))  # each worker: its own rows

    @tf.function
    def mw_step(iterator):
        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(yb, mw_model(xb, training=True))) / global_batch
            grads = tape.gradient(loss, mw_model.trainable_variables)
            mw_opt.apply_gradients(zip(grads, mw_model.trainable_variables))
            return loss

        xb, yb = next(iterator)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step_fn, args=(xb, yb)), axis=None)

    def run_mwms(steps: int) -> None:
        for _ in range(steps):
            loss = mw_step(mw_iter)
        float(loss)  # wait for the last step

    contenders = {"shardwise fit + DistributedOptimizer (mpi)": run_shardwise,
                  "MWMS strategy.run custom loop (ring)": run_mwms}
    for run in contenders.values():  # warm-up: tracing, first collectives
        run(3)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name].append(timed(lambda: contenders[name](args.steps)))
    check_synchronized(sw_model.get_weights(), "shardwise")
    check_synchronized(mw_model.get_weights(), "MWMS")

    if rank == 0:
        params = sw_model.count_params()
        print(f"keras_dp: {size} workers, Keras {keras.__version__} / TF {tf.__version__}, MLP "
              f"{'-'.join(map(str, WIDTHS + (CLASSES,)))} ({params / 1e6:.1f}M params), SGD, batch {b}/worker, "
              f"{args.threads} intra-op thread(s), {args.steps} steps x {args.rounds} rounds (median, slowest "
              f"rank), mpi_yield_when_idle={os.environ.get('OMPI_MCA_mpi_yield_when_idle')}")
        print(f"{'contender':<46}{'steps/s':>9}{'ms/step':>10}   per-round steps/s")
        rate = {}
        for name, ts in times.items():
            rate[name] = args.steps / statistics.median(ts)
            rounds = " ".join(f"{args.steps / t:.2f}" for t in ts)
            print(f"{name:<46}{rate[name]:>9.2f}{1000 / rate[name]:>10.1f}   {rounds}")
        ratio = rate[order[0]] / rate[order[1]]
        print(f"ratio shardwise/MWMS: {ratio:.2f}x (target >= 1.2x)")


if __name__ == "__main__":
    main()
