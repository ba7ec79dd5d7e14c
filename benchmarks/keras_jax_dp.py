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


def finish_job(model: Any, seconds: float, path: str | None, **info: Any) -> None:
    """Save the final weights to ``path`` (when given) and print the ``RESULT`` line the driver reads."""
    if path:
        np.savez(path, *model.get_weights())
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
    x, y = worker_data(comm.rank, comm.size, args.batch, max(args.steps, WARMUP_STEPS))
    model = build_model()
    run = compiled_fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), x, y, args.batch)
    hvd.broadcast_variables(model.variables, root_rank=0)
    run(WARMUP_STEPS)
    seconds = timed(lambda: run(args.steps))
    check_synchronized(model.get_weights(), SHARDWISE)
    if comm.rank == 0:
        finish_job(model, seconds, args.save_weights)


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
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    parts = [worker_data(r, n, args.batch, max(args.steps, WARMUP_STEPS)) for r in range(n)]
    x = global_batches([xp for xp, _ in parts], args.batch)
    y = global_batches([yp for _, yp in parts], args.batch)
    model = build_model()
    run = compiled_fit(model, keras.optimizers.SGD(0.01), x, y, n * args.batch)
    run(WARMUP_STEPS)
    t0 = time.perf_counter()
    run(args.steps)
    finish_job(model, time.perf_counter() - t0, args.save_weights, cores=len(os.sched_getaffinity(0)))


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
    cores: list[str] = []
    with tempfile.TemporaryDirectory(prefix="keras_jax_dp-") as tmp:
        saved = {SHARDWISE: os.path.join(tmp, "shardwise.npz"), DATA_PARALLEL: os.path.join(tmp, "keras-dp.npz")}
        shardwise_argv = build_command(find_launcher(), args.np, job + ["--role", "shardwise", "--save-weights",
                                                                         saved[SHARDWISE]], env=env)
        data_parallel_argv = job + ["--role", "keras-dp", "--save-weights", saved[DATA_PARALLEL]]

        def shardwise_round() -> float:
            return float(run_job(shardwise_argv, env)["seconds"])

        def data_parallel_round() -> float:
            result = run_job(data_parallel_argv, env)
            cores.append(result["cores"])
            return float(result["seconds"])

        times = interleave({SHARDWISE: shardwise_round, DATA_PARALLEL: data_parallel_round}, args.rounds)
        final = {name: load_weights(path) for name, path in saved.items()}

    n, b = args.np, args.batch
    print(f"keras_dp [jax]: {n} workers, Keras {version('keras')} / JAX {version('jax')}, {model_name()}, "
          f"SGD(0.01), batch {b}/worker, jit_compile=True, {args.steps} steps x {args.rounds} rounds (median, "
          f"slowest rank; each round two fresh jobs, start-up and compilation untimed), {yield_setting()}")
    print(f"# shardwise: {n} MPI ranks (mpi backend), 1 XLA intra-op thread each; DataParallel: 1 process, "
          f"{n} host devices, global batch {n * b}, XLA thread pool on {cores[0]} core(s)")
    rate = report(times, args.steps)
    print(f"ratio shardwise/keras-DataParallel: {rate[SHARDWISE] / rate[DATA_PARALLEL]:.2f}x")
    print(f"final weights after {WARMUP_STEPS + args.steps} steps on the same batches, "
          f"max |shardwise - DataParallel|: {max_difference(final[SHARDWISE], final[DATA_PARALLEL]):.1e}")
