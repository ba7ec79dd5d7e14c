"""The jax mode of ``keras_dp.py``: shardwise Keras-on-JAX ``fit`` on N ranks vs ``keras.distribution.DataParallel``.

Run without mpirun (the script launches its own jobs):
    python benchmarks/keras_dp.py --keras-backend jax --np 2

The two cannot share processes: DataParallel spans the N host CPU devices of one
process, shardwise spans N processes. Run without ``--role`` the script is a driver:
each round it starts both contenders as fresh jobs, one after the other,
alternating which goes first, and reads each job's own timing from its
``RESULT seconds=...`` line.

* ``--role shardwise``, under ``mpirun -np N``: ``shardwise.init(backend="mpi")`` and
  Keras 3 (jax backend) ``fit`` with ``shardwise.keras.DistributedOptimizer``; the
  gradients leave the jitted train step through an ordered ``io_callback``, one MPI
  allreduce per bucket. One intra-op thread per rank
  (``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false``).
* ``--role keras-dp``, one process: ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
  and ``keras.distribution.DataParallel`` over those N devices; the global batch of
  N x ``--batch`` rows is laid out so that device r sees exactly rank r's batch, and
  XLA's in-process all-reduce averages the gradients. XLA's thread pool stays on,
  confined to N cores (CPU affinity) when the host has more: the same total as the
  N single-threaded ranks.

With ``--zero3`` both train with Adam(1e-3): shardwise with
``ZeroOptimizer(stage=3)`` (each rank keeps 1/N of every variable), and the peer with
``keras.distribution.ModelParallel`` over a one-axis mesh of the N devices, every
kernel and bias laid out along that axis (their first dimension split N ways) and the
batch split along it too: GSPMD's fully sharded data parallelism, the same sharding
over the same number of devices. Each job also reports its peak resident memory
above the baseline taken after its imports; the peer's one process holds all N
devices, so its per-device figure is that peak / N.

Both use ``jit_compile=True``. Each job builds the model from the same seeded
initialisers, warms up (compilation, then ``WARMUP_STEPS`` steps), and times
``--steps`` steps of ``fit`` up to the final weights being ready (slowest rank for
shardwise); start-up and compilation are never timed. Each job saves its final
weights, and the driver reports how far apart the two contenders end.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from keras_dp import (WARMUP_STEPS, build_model, check_synchronized, interleave, max_difference, model_name,
                      report, timed, worker_data, yield_setting)

__all__ = ["run_jax"]

SHARDWISE = "shardwise fit + DistributedOptimizer (mpi)"
DATA_PARALLEL = "keras.distribution.DataParallel (1 process)"
SHARDWISE_ZERO3 = "shardwise fit + ZeroOptimizer(stage=3) (mpi)"
MODEL_PARALLEL = "keras.distribution.ModelParallel, variables sharded (1 process)"
MIB = 2 ** 20
JOB_TIMEOUT_S = 900
_RESULT = re.compile(r"^RESULT (.+)$", re.M)


def run_jax(args: argparse.Namespace) -> None:
    """The driver, or one contender's job when ``--role`` is given."""
    if args.role == "shardwise":
        shardwise_job(args)
    elif args.role == "keras-dp":
        data_parallel_job(args)
    else:
        drive(args)


def add_xla_flags(flags: str) -> None:
    """Append to ``XLA_FLAGS``; call before jax is imported."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


def compiled_fit(model: Any, optimizer: Any, x: np.ndarray, y: np.ndarray, batch: int) -> Callable[[int], None]:
    """Compile ``model`` for XLA; return ``run(steps)``: that many steps of ``fit`` from the first batch.

    ``run`` returns once the final weights are computed (JAX dispatches asynchronously).
    """
    import jax
    import keras

    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)

    def run(steps: int) -> None:
        model.fit(x, y, batch_size=batch, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)
        jax.block_until_ready([v.value for v in model.variables])

    return run


def finish_job(weights: list[np.ndarray], seconds: float, path: str | None, **info: Any) -> None:
    """Save the final weights to ``path`` (when given) and print the ``RESULT`` line the driver reads."""
    if path:
        np.savez(path, *weights)
    fields = " ".join(f"{k}={v}" for k, v in dict(seconds=repr(seconds), **info).items())
    print(f"RESULT {fields}", flush=True)


def load_weights(path: str) -> list[np.ndarray]:
    """The weights ``finish_job`` saved, in order."""
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def shardwise_job(args: argparse.Namespace) -> None:
    """One rank of the shardwise contender (run under mpirun)."""
    add_xla_flags("--xla_cpu_multi_thread_eigen=false")
    import shardwise

    comm = shardwise.init(backend="mpi").world
    import keras

    import shardwise.keras as hvd

    if comm.size != args.np:
        raise SystemExit(f"the shardwise job expected {args.np} ranks, mpirun started {comm.size}")
    from _peak import start_on_every_rank, status

    x, y = worker_data(comm.rank, comm.size, args.batch, max(args.steps, WARMUP_STEPS))
    base = start_on_every_rank(comm)
    model = build_model()
    initial = sample(model.get_weights())  # before fit; a sample, so the peak holds no second model
    if args.zero3:
        optimizer = hvd.ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=3)
    else:
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
    run = compiled_fit(model, optimizer, x, y, args.batch)
    hvd.broadcast_variables(model.variables, root_rank=0)
    run(WARMUP_STEPS)
    seconds = timed(lambda: run(args.steps))
    peak = max(comm.allgather_object(status("VmHWM") - base))
    weights = model.get_weights()  # a collective at ZeRO-3: every rank reads them
    check_synchronized(weights, SHARDWISE_ZERO3 if args.zero3 else SHARDWISE)
    if comm.rank == 0:
        finish_job(weights, seconds, args.save_weights, peak=peak, moved=max_difference(sample(weights), initial))


def sample(weights: list[np.ndarray], size: int = 4096) -> list[np.ndarray]:
    """The first ``size`` values of each weight, copied: enough to see whether training moved it."""
    return [np.array(w.ravel()[:size]) for w in weights]


def global_batches(parts: Sequence[np.ndarray], batch: int) -> np.ndarray:
    """The workers' arrays merged batch by batch: global batch i is every worker's batch i, in rank order."""
    steps = len(parts[0]) // batch
    stacked = np.stack([p[:steps * batch].reshape(steps, batch, *p.shape[1:]) for p in parts], axis=1)
    return stacked.reshape(steps * len(parts) * batch, *parts[0].shape[1:])


def data_parallel_job(args: argparse.Namespace) -> None:
    """The keras.distribution.DataParallel contender: one process, ``--np`` host devices."""
    n = args.np
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > n:
        os.sched_setaffinity(0, cpus[:n])
    add_xla_flags(f"--xla_force_host_platform_device_count={n}")
    import jax
    import keras

    devices = jax.devices()
    if len(devices) != n:
        raise SystemExit(f"expected {n} host devices, jax sees {len(devices)}: was jax imported before XLA_FLAGS?")
    from _peak import start_on_every_rank, status

    if args.zero3:
        mesh = keras.distribution.DeviceMesh((n,), axis_names=("batch",), devices=devices)
        layouts = keras.distribution.LayoutMap(mesh)
        layouts[".*kernel"] = ("batch", None)
        layouts[".*bias"] = ("batch",)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layouts,
                                                                             batch_dim_name="batch"))
    else:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    parts = [worker_data(r, n, args.batch, max(args.steps, WARMUP_STEPS)) for r in range(n)]
    x = global_batches([xp for xp, _ in parts], args.batch)
    y = global_batches([yp for _, yp in parts], args.batch)
    base = start_on_every_rank(_OneProcess())
    model = build_model()
    optimizer = keras.optimizers.Adam(1e-3) if args.zero3 else keras.optimizers.SGD(0.01)
    run = compiled_fit(model, optimizer, x, y, n * args.batch)
    run(WARMUP_STEPS)
    t0 = time.perf_counter()
    run(args.steps)
    seconds = time.perf_counter() - t0
    finish_job(model.get_weights(), seconds, args.save_weights, cores=len(os.sched_getaffinity(0)),
               peak=status("VmHWM") - base)


class _OneProcess:
    """The one-process peer's stand-in for a communicator: nothing to wait for."""

    def barrier(self) -> None:
        return None


def run_job(argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """Run one contender's job; its ``RESULT`` fields, or exit with its output when it fails."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise SystemExit(f"{' '.join(argv)} hung: killed after {JOB_TIMEOUT_S} s\n{out[-4000:]}") from None
    except BaseException:  # e.g. Ctrl-C: the job runs in its own session and would outlive the driver
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    found = _RESULT.findall(out)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{' '.join(argv)} failed (exit {proc.returncode})\n{out[-4000:]}")
    return dict(field.split("=", 1) for field in found[-1].split())


def drive(args: argparse.Namespace) -> None:
    """Each round: one shardwise job and one DataParallel job, alternating which goes first."""
    from shardwise.core.launch_env import detect_launch
    from shardwise.cli.launch import build_command, find_launcher, launch_env

    if detect_launch().size > 1:
        raise SystemExit("the jax mode starts its own jobs: run it without mpirun (python benchmarks/keras_dp.py "
                         "--keras-backend jax --np N)")
    env = launch_env(dict(os.environ, KERAS_BACKEND="jax"))
    job = [sys.executable, str(Path(__file__).with_name("keras_dp.py")), "--keras-backend", "jax",
           "--steps", str(args.steps), "--batch", str(args.batch), "--np", str(args.np)]
    job += ["--zero3"] if args.zero3 else []
    ours, peer = (SHARDWISE_ZERO3, MODEL_PARALLEL) if args.zero3 else (SHARDWISE, DATA_PARALLEL)
    peaks: dict[str, list[int]] = {ours: [], peer: []}
    cores: list[str] = []
    moved: list[float] = []
    with tempfile.TemporaryDirectory(prefix="keras_jax_dp-") as tmp:
        saved = {ours: os.path.join(tmp, "shardwise.npz"), peer: os.path.join(tmp, "keras-dp.npz")}
        shardwise_argv = build_command(find_launcher(), args.np, job + ["--role", "shardwise", "--save-weights",
                                                                         saved[ours]], env=env)
        data_parallel_argv = job + ["--role", "keras-dp", "--save-weights", saved[peer]]

        def shardwise_round() -> float:
            result = run_job(shardwise_argv, env)
            peaks[ours].append(int(result["peak"]))
            moved.append(float(result["moved"]))
            return float(result["seconds"])

        def data_parallel_round() -> float:
            result = run_job(data_parallel_argv, env)
            cores.append(result["cores"])
            peaks[peer].append(int(result["peak"]))
            return float(result["seconds"])

        times = interleave({ours: shardwise_round, peer: data_parallel_round}, args.rounds)
        final = {name: load_weights(path) for name, path in saved.items()}

    n, b = args.np, args.batch
    optimizer = "Adam(1e-3)" if args.zero3 else "SGD(0.01)"
    peer_name = "ModelParallel" if args.zero3 else "DataParallel"
    print(f"keras_dp [jax]: {n} workers, Keras {version('keras')} / JAX {version('jax')}, {model_name()}, "
          f"{optimizer}, batch {b}/worker, jit_compile=True, {args.steps} steps x {args.rounds} rounds (median, "
          f"slowest rank; each round two fresh jobs, start-up and compilation untimed), {yield_setting()}")
    print(f"# shardwise: {n} MPI ranks (mpi backend), 1 XLA intra-op thread each; {peer_name}: 1 process, "
          f"{n} host devices, global batch {n * b}, XLA thread pool on {cores[0]} core(s)")
    rate = report(times, args.steps)
    print(f"ratio shardwise/keras-{peer_name} step rate: {rate[ours] / rate[peer]:.2f}x")
    mine, theirs = statistics.median(peaks[ours]) / MIB, statistics.median(peaks[peer]) / MIB
    print(f"peak memory above the baseline (median over rounds): shardwise {mine:.1f} MiB per rank (largest "
          f"rank); {peer_name} {theirs:.1f} MiB for its one process = {theirs / n:.1f} MiB per device; "
          f"ratio per rank / per device {mine / max(theirs / n, 1e-9):.2f}x")
    print(f"final weights after {WARMUP_STEPS + args.steps} steps on the same batches, "
          f"max |shardwise - {peer_name}|: {max_difference(final[ours], final[peer]):.1e} (shardwise's weights "
          f"moved by up to {min(moved):.1e} from their initial values; with a power-of-two batch, averaging the "
          "ranks' mean gradients and the one process's global mean round alike, so 0 is possible)")
