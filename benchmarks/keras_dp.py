"""Keras 3 data-parallel training speed: shardwise ``model.fit`` vs each Keras backend's own data parallelism.

The Keras backend is ``KERAS_BACKEND`` or ``--keras-backend`` (which sets it before
Keras is imported); tensorflow when neither is given. Every mode trains the same
Keras 3 MLP (``WIDTHS``, about 6.3M parameters) from the same initial weights on the
same per-worker data with SGD(0.01), and times ``--steps`` steps of ``model.fit``
(``steps_per_epoch=steps, epochs=1``) after warm-up against as many steps of the peer.
Rounds alternate which contender goes first so machine noise hits both alike; the
slowest rank's time counts and the tables show the median over rounds; the ratio
printed is shardwise / peer. The tensorflow and torch pairs run in the same
processes, and the torch pair on one transport (gloo); the jax peer has no
transport to share (its devices live in one process, XLA reduces in memory).

tensorflow -- ``mpirun -np 2 python benchmarks/keras_dp.py`` (or ``shardwise run -np 2 -- ...``)
    shardwise ``fit`` + ``shardwise.keras.DistributedOptimizer`` on the mpi backend
    (gradients fused into buckets, one MPI allreduce per bucket) vs
    ``tf.distribute.MultiWorkerMirroredStrategy`` (TF_CONFIG derived from the MPI
    ranks by ``shardwise.tensorflow.strategy()``) with a ``strategy.run`` custom loop,
    in the same processes. Keras 3 ``model.fit`` under MWMS fails on multi-worker CPU
    (keras-team/keras#20585), hence the custom loop, which is also MWMS's fastest path.
    Both read the same tf.data pipeline (fixed prefetch, autotuning off: with it on,
    deleting the iterator at the end of a ``fit`` call often waited ~1.2 s for
    tf.data's autotune thread on 2 busy workers, a per-call cost real epochs amortise
    but 20-step rounds would not; MWMS's loop keeps one iterator and never paid it).

torch -- ``mpirun -np 2 python benchmarks/keras_dp.py --keras-backend torch``
    see ``keras_torch_dp.py``: shardwise Keras-on-torch ``fit`` on the torch backend
    (gloo) vs ``torch.nn.parallel.DistributedDataParallel`` with a plain torch loop on
    the same gloo group, in the same processes; a second table times shardwise
    Keras-on-torch on the mpi backend alone.

torch, ZeRO-3 -- ``mpirun -np 2 python benchmarks/keras_dp.py --keras-backend torch --zero3``
    see ``keras_torch_zero3.py``: Keras-on-torch ``fit`` with ``ZeroOptimizer(stage=3)`` vs
    torch FSDP2 (``fully_shard``) on the same gloo group, Adam; peak memory per rank too.

jax -- ``python benchmarks/keras_dp.py --keras-backend jax --np 2`` (no mpirun: it launches its own jobs)
    see ``keras_jax_dp.py``: shardwise Keras-on-JAX ``fit`` on N MPI ranks vs
    ``keras.distribution.DataParallel`` in one process over N host CPU devices, each
    round as two fresh jobs. With ``--zero3``: ``ZeroOptimizer(stage=3)`` vs
    ``keras.distribution.ModelParallel`` sharding every variable over the same N devices.

Every multi-process contender ends with identical weights on every rank (checked), so it
really trains data-parallel; the torch and jax modes also report how far shardwise's final
weights are from the peer's, which trained on the same batches.

OpenMPI busy-polls while a rank waits in a collective, which steals the CPU from
the peer's compute when ranks share cores (2 workers on a small or busy host).
The script sets ``OMPI_MCA_mpi_yield_when_idle=1`` (OpenMPI's own advice for
oversubscribed nodes) unless the variable is already set; MWMS's gRPC and gloo's
waits block anyway. Pass ``OMPI_MCA_mpi_yield_when_idle=0`` to measure without it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")  # read at MPI_Init, i.e. the mpi4py import

import numpy as np  # noqa: E402

WIDTHS = (1024, 2048, 2048)
CLASSES = 10
WARMUP_STEPS = 3
BACKENDS = ("tensorflow", "torch", "jax")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keras-backend", choices=BACKENDS,
                        default=os.environ.get("KERAS_BACKEND", "tensorflow"),
                        help="Keras backend (default: KERAS_BACKEND, else tensorflow)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="samples per worker per step")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="torch: gradient bucket size for shardwise and DDP alike (DDP's default: 25)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per worker (tensorflow, torch; jax ranks run XLA single-threaded)")
    parser.add_argument("--np", type=int, default=2, help="jax: ranks (shardwise) and host devices (DataParallel)")
    parser.add_argument("--zero3", action="store_true",
                        help="torch: Keras ZeRO-3 vs FSDP2; jax: Keras ZeRO-3 vs keras.distribution.ModelParallel "
                             "(Adam(1e-3), peak memory per rank too)")
    parser.add_argument("--role", choices=("shardwise", "keras-dp"), help=argparse.SUPPRESS)  # jax: one job
    parser.add_argument("--save-weights", help=argparse.SUPPRESS)  # jax: where a job leaves its final weights
    return parser.parse_args()


def build_model() -> Any:
    """The benchmark MLP, with seeded initialisers (``keras.utils.set_random_seed`` would import TensorFlow)."""
    import keras

    init = keras.initializers.GlorotUniform
    hidden = [keras.layers.Dense(w, activation="relu", kernel_initializer=init(seed=i))
              for i, w in enumerate(WIDTHS[1:])]
    head = keras.layers.Dense(CLASSES, kernel_initializer=init(seed=len(hidden)))
    return keras.Sequential([keras.Input((WIDTHS[0],)), *hidden, head])


def model_name() -> str:
    """``MLP 1024-2048-2048-10 (6.3M params)``."""
    widths = WIDTHS + (CLASSES,)
    params = sum((fan_in + 1) * fan_out for fan_in, fan_out in zip(widths, widths[1:]))
    return f"MLP {'-'.join(map(str, widths))} ({params / 1e6:.1f}M params)"


def worker_data(rank: int, size: int, batch: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """This worker's rows of one global dataset (every size-th row, as shardwise.tensorflow.shard)."""
    rng = np.random.default_rng(0)
    n = size * batch * steps
    x = rng.normal(size=(n, WIDTHS[0])).astype("float32")
    y = rng.integers(0, CLASSES, size=n).astype("int32")
    return x[rank::size], y[rank::size]


def mpi_world() -> Any:
    """mpi4py's COMM_WORLD, imported late: the jax driver and its DataParallel job never start MPI."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def timed(run: Callable[[], None]) -> float:
    """Seconds ``run`` took on the slowest rank, all ranks starting together."""
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    run()
    return MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def check_synchronized(weights: list[np.ndarray], what: str) -> None:
    digest = np.array([float(np.sum(w, dtype=np.float64)) for w in weights])
    every = mpi_world().allgather(digest)
    if any(not np.array_equal(every[0], d) for d in every[1:]):
        raise SystemExit(f"{what}: weights differ across ranks after training")


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Largest absolute difference between two lists of same-shaped weights."""
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b, strict=True))


def interleave(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each contender's seconds per round; odd rounds run the contenders in reverse order."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name].append(contenders[name]())
    return times


def time_rounds(contenders: dict[str, Callable[[int], None]], steps: int, rounds: int) -> dict[str, list[float]]:
    """Warm every contender up, then :func:`interleave` ``steps`` steps of each, timed on the slowest rank."""
    for run in contenders.values():  # tracing or compilation, buckets, optimizer state, first collectives
        run(WARMUP_STEPS)
    return interleave({name: (lambda run=run: timed(lambda: run(steps))) for name, run in contenders.items()},
                      rounds)


def report(times: dict[str, list[float]], steps: int) -> dict[str, float]:
    """Print a table of median steps/s, ms/step and every round's steps/s; return the median rates."""
    width = max(46, max(map(len, times)) + 2)
    print(f"{'contender':<{width}}{'steps/s':>9}{'ms/step':>10}   per-round steps/s")
    rate = {}
    for name, ts in times.items():
        rate[name] = steps / statistics.median(ts)
        rounds = " ".join(f"{steps / t:.2f}" for t in ts)
        print(f"{name:<{width}}{rate[name]:>9.2f}{1000 / rate[name]:>10.1f}   {rounds}")
    return rate


def yield_setting() -> str:
    return f"mpi_yield_when_idle={os.environ.get('OMPI_MCA_mpi_yield_when_idle')}"


def run_tensorflow(args: argparse.Namespace) -> None:
    """shardwise fit + DistributedOptimizer (mpi) vs an MWMS custom loop, in the same processes."""
    import shardwise

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
    times = time_rounds(contenders, args.steps, args.rounds)
    check_synchronized(sw_model.get_weights(), "shardwise")
    check_synchronized(mw_model.get_weights(), "MWMS")

    if rank == 0:
        print(f"keras_dp [tensorflow]: {size} workers, Keras {keras.__version__} / TF {tf.__version__}, "
              f"{model_name()}, SGD, batch {b}/worker, {args.threads} intra-op thread(s), "
              f"{args.steps} steps x {args.rounds} rounds (median, slowest rank), {yield_setting()}")
        rate = report(times, args.steps)
        sw, peer = rate.values()
        print(f"ratio shardwise/MWMS: {sw / peer:.2f}x (target >= 1.2x)")


def main() -> None:
    args = parse()
    os.environ["KERAS_BACKEND"] = args.keras_backend  # before anything imports keras
    if args.keras_backend == "tensorflow":
        run_tensorflow(args)
    elif args.keras_backend == "torch" and args.zero3:
        from keras_torch_zero3 import run_torch_zero3

        run_torch_zero3(args)
    elif args.keras_backend == "torch":
        from keras_torch_dp import run_torch

        run_torch(args)
    else:
        from keras_jax_dp import run_jax

        run_jax(args)


if __name__ == "__main__":
    main()
