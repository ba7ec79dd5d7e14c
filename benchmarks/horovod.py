"""Horovod itself vs shardwise: DistributedOptimizer step time and allreduce bandwidth.

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/horovod.py
(needs Horovod built into the venv: bash scripts/horovod/build.sh).

One job runs every variant, interleaved round by round so machine noise hits them
alike; each figure is the median over rounds of the median over repetitions.

* Training step (forward + backward + step, SGD) of one MLP (>= 10M parameters) with
  ``horovod.torch.DistributedOptimizer`` vs ``shardwise.torch.DistributedOptimizer`` on
  the ``mpi`` backend and on the ``horovod`` backend. Ratios: time / Horovod's time.
* Allreduce algbw (GB/s, in place, float32 sum) of ``horovod.torch.allreduce_`` vs
  shardwise's ``mpi`` and ``horovod`` backends, 1-64 MiB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

# Run as a script, this file's folder comes first on sys.path and this file would shadow
# the ``horovod`` package: drop that folder before anything imports horovod.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from mpi4py import MPI  # noqa: F401 - MPI is initialised (and finalised) by mpi4py, before Horovod

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
import shardwise.torch as swt
from shardwise.backends.mpi import MPICommunicator

SIZES_MIB = (1, 4, 16, 64)


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def _median(fn: Callable[[], None], reps: int, barrier: Callable[[], None]) -> float:
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _optimizer(label: str, width: int, comm: object, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One training step of a fresh model with ``label``'s DistributedOptimizer, warmed up."""
    import horovod.torch as hvd

    model = _model(width)
    base = torch.optim.SGD(model.parameters(), lr=1e-3)
    if label == "horovod.torch":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=hvd.Average)
    else:
        opt = swt.DistributedOptimizer(base, named_parameters=model.named_parameters(), process_set=comm)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # buckets, Horovod's response cache
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048, help="MLP width (2048: 10.5M parameters)")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    # Horovod's background thread talks MPI every cycle; on few cores it slows other MPI
    # traffic in the process several-fold. So each round has an mpi phase with Horovod shut
    # down and a horovod phase with it running (hvd.init() again: about 10 ms).
    mpi = MPICommunicator()
    rank, size = mpi.rank, mpi.size
    torch.manual_seed(1 + rank)
    x, y = torch.randn(args.batch, 1024), torch.randint(0, 10, (args.batch,))
    params = sum(p.numel() for p in _model(args.width).parameters())
    labels = ("horovod.torch", "shardwise mpi", "shardwise horovod")
    buffers = {mib: np.ones((mib << 20) // 4, dtype=np.float32) for mib in SIZES_MIB}
    tensors = {mib: torch.from_numpy(buffers[mib].copy()) for mib in SIZES_MIB}
    step_times: dict[str, list[float]] = {k: [] for k in labels}
    bw_times: dict[tuple[str, int], list[float]] = {(k, mib): [] for k in labels for mib in SIZES_MIB}
    mpi_step = _optimizer("shardwise mpi", args.width, mpi, x, y)

    def measure(steps: dict, reduce: dict) -> None:
        for label, fn in steps.items():
            step_times[label].append(_median(fn, args.reps, mpi.barrier))
        for mib in SIZES_MIB:
            for label, fn in reduce.items():
                fn(mib)
                bw_times[(label, mib)].append(_median(lambda: fn(mib), args.reps * 2, mpi.barrier))

    for _ in range(args.rounds):
        measure({"shardwise mpi": mpi_step},
                {"shardwise mpi": lambda mib: mpi.allreduce(buffers[mib], inplace=True)})
        world = shardwise.init(backend="horovod").world
        import horovod.torch as hvd

        measure({label: _optimizer(label, args.width, world, x, y) for label in labels if label != "shardwise mpi"},
                {"horovod.torch": lambda mib: hvd.allreduce_(tensors[mib], op=hvd.Sum, name=f"bench.{mib}"),
                 "shardwise horovod": lambda mib: world.allreduce(tensors[mib], inplace=True, name=f"bench.{mib}")})
        shardwise.shutdown()  # hvd.shutdown(): the next mpi phase runs without Horovod's thread

    if rank == 0:
        ref = statistics.median(step_times["horovod.torch"])
        print(f"# DistributedOptimizer step, {params / 1e6:.1f}M parameters (fp32), batch {args.batch}/rank, "
              f"{size} ranks, median of {args.rounds} rounds x {args.reps} steps")
        print(f"{'variant':<20} {'step ms':>9} {'vs horovod':>11}")
        for label in labels:
            t = statistics.median(step_times[label])
            print(f"{label:<20} {t * 1e3:9.1f} {t / ref:10.2f}x")
        print(f"\n# allreduce in place, float32 sum, algbw GB/s (bytes / time), {size} ranks")
        print(f"{'size':>7} " + " ".join(f"{k:>18}" for k in labels) + f" {'mpi/hvd':>8} {'sw-hvd/hvd':>10}")
        for mib in SIZES_MIB:
            bw = {k: (mib << 20) / statistics.median(bw_times[(k, mib)]) / 1e9 for k in labels}
            print(f"{mib:>4}MiB " + " ".join(f"{bw[k]:18.2f}" for k in labels)
                  + f" {bw['shardwise mpi'] / bw['horovod.torch']:7.2f}x"
                  + f" {bw['shardwise horovod'] / bw['horovod.torch']:9.2f}x")
    mpi.free()


if __name__ == "__main__":
    main()
