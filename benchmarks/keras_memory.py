"""Peak memory per rank of a Keras 3 model bigger than one rank: ZeRO-3 vs replicated data parallelism.

    python benchmarks/keras_memory.py                               # torch and jax, N = 4
    python benchmarks/keras_memory.py --keras-backend torch --np 4
    python benchmarks/keras_memory.py --contenders zero3 --depth 25 100   # 103M and 418M MLPs

Each row is its own ``shardwise run -np N`` job (MPI). Each rank imports Keras on the
chosen backend and shardwise, starts the backend, hands freed memory back to the OS,
resets its resident-set high-water mark and takes its resident set as the baseline
(``_peak.start_on_every_rank``, as every benchmark here); then it builds the model,
compiles it with the contender's optimizer and runs ``model.fit`` for 2 Adam steps.
Peak = ``VmHWM`` - baseline, the largest over ranks; "after build" is the same
high-water mark read once the model exists and its optimizer is built.

Contenders, on the same MLP (``--depth`` Dense(2048) layers: 25 by default, about 103M
parameters; 100 is about 418M):

* ``zero3``: ``shardwise.keras.ZeroOptimizer(Adam, stage=3)``, the model built inside
  ``shardwise.keras.sharded_build()`` (``--eager-build``: built whole on every rank), so
  no rank ever holds the whole model;
* ``dp``: ``shardwise.keras.DistributedOptimizer(Adam)``, every rank holding the whole
  model, its gradients and Adam's two moments: the replicated reference.

Activations are measured, not modelled: the same job runs again with twice the
per-rank batch, and the difference of the two peaks is what grows with the batch.
Issue 38's bound is ``1.3 x (16 bytes x parameters / N) + activations``, and the peak
must also be below the whole fp32 model (4 bytes x parameters). At N = 4 the two
coincide with 16 B x P / N, and what does not grow with the model (on JAX: XLA's code
paged in, its compiled step and compilation caches, together about 120 MiB per rank)
weighs less the bigger the model: hence the deeper row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
INPUTS, WIDTH, DEPTH, CLASSES = 1024, 2048, 25, 10


def parameter_count(depth: int = DEPTH) -> int:
    """Parameters of the benchmark MLP with ``depth`` hidden layers (kernels and biases)."""
    widths = [INPUTS] + [WIDTH] * depth + [CLASSES]
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


def build_model(keras: Any, depth: int = DEPTH) -> Any:
    """The benchmark MLP with ``depth`` hidden layers, seeded, built (variables created)."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((INPUTS,))] + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(depth)]
    return keras.Sequential(layers + [keras.layers.Dense(CLASSES)])


def worker(spec: dict[str, Any]) -> None:
    """One rank of one row: build, compile, 2 Adam steps of fit; rank 0 prints the peaks as JSON."""
    import numpy as np

    import shardwise
    from _peak import start_on_every_rank, status

    world = shardwise.init(backend="mpi").world
    import keras

    import shardwise.keras as hvd

    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(1)
    keras.utils.set_random_seed(0)  # its first call imports TensorFlow when installed: before the baseline
    base = start_on_every_rank(world)
    sharded = spec["contender"] == "zero3" and spec["sharded_build"]
    if sharded:
        with hvd.sharded_build():
            model = build_model(keras, spec["depth"])
    else:
        model = build_model(keras, spec["depth"])
    if spec["contender"] == "zero3":
        optimizer = hvd.ZeroOptimizer(keras.optimizers.Adam(1e-4), stage=3)
    else:
        optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-4))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(world.rank)
    batch = spec["batch"]
    x = rng.standard_normal((2 * batch, INPUTS), dtype=np.float32)
    y = rng.integers(0, CLASSES, 2 * batch)
    model.optimizer.build(model.trainable_variables)
    built = status("VmHWM") - base
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    peak = status("VmHWM") - base
    every = world.allgather_object((peak, built))
    if world.rank == 0:
        print("RESULT " + json.dumps({"peak": max(p for p, _ in every), "built": max(b for _, b in every),
                                      "sharded_build": sharded}), flush=True)


def _run(np_: int, backend: str, spec: dict[str, Any]) -> dict[str, Any]:
    """This script's worker on ``np_`` ranks; the JSON its rank 0 printed after ``RESULT``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip(),
               PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]))
    cmd = [str(Path(sys.executable).with_name("shardwise")), "run", "-np", str(np_), "--", sys.executable,
           __file__, "--worker", json.dumps(spec)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{backend} {np_} ranks {spec}: exit {out.returncode}\n{out.stdout[-3000:]}\n"
                         f"{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--keras-backend", nargs="*", default=["torch", "jax"], choices=["torch", "jax"])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank")
    parser.add_argument("--contenders", nargs="*", default=["zero3", "dp"], choices=["zero3", "dp"])
    parser.add_argument("--depth", type=int, nargs="*", default=[DEPTH], help="hidden layers (one row each)")
    parser.add_argument("--eager-build", action="store_true", help="ZeRO-3 rows build the whole model on every rank")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    rows = []
    for depth in args.depth:
        for backend in args.keras_backend:
            for contender in args.contenders:
                spec = {"contender": contender, "sharded_build": not args.eager_build, "depth": depth}
                one = _run(args.np, backend, dict(spec, batch=args.batch))
                two = _run(args.np, backend, dict(spec, batch=2 * args.batch))
                rows.append((depth, backend, contender, one, two))
                print(f"{depth} layers, {backend} {contender}: peak {one['peak'] / MIB:.1f} MiB "
                      f"(2x batch {two['peak'] / MIB:.1f})", flush=True)
    print()
    print(f"Keras MLP {INPUTS}-{WIDTH}x(layers)-{CLASSES}, Adam, N = {args.np} MPI ranks, 2 fit steps, batch "
          f"{args.batch}/rank; peak resident memory per rank above the imports (largest rank)")
    print()
    print("| layers | params | fp32 model MiB | Keras backend | contender | build | peak MiB | after build MiB "
          "| x fp32 model | activations MiB | 16 B x P / N MiB | bound 1.3 x ideal + act. MiB | peak / bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for depth, backend, contender, one, two in rows:
        params = parameter_count(depth)
        model_mib, ideal = 4 * params / MIB, 16 * params / args.np / MIB
        peak, act = one["peak"] / MIB, max(two["peak"] - one["peak"], 0) / MIB
        bound = 1.3 * ideal + act
        build = "sharded" if one.get("sharded_build") else "whole model per rank"
        name = "ZeRO-3" if contender == "zero3" else "DistributedOptimizer (replicated)"
        print(f"| {depth} | {params / 1e6:.1f}M | {model_mib:.0f} | {backend} | {name} | {build} | {peak:.0f} "
              f"| {one['built'] / MIB:.0f} | {peak / model_mib:.2f}x | {act:.0f} | {ideal:.0f} | {bound:.0f} "
              f"| {peak / bound:.2f}x |")

if __name__ == "__main__":
    main()
