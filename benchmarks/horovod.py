"""Horovod itself vs shardwise: DistributedOptimizer step time and allreduce bandwidth, per transport.

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/horovod.py
(needs Horovod built into the venv: bash scripts/horovod/build.sh; without it the script
stops at once with that message).

One job, each round in two phases (Horovod's background thread talks MPI every cycle; on
few cores it slows other MPI traffic in the process several-fold, so the mpi phase runs
with Horovod shut down):

* mpi phase: ``shardwise.init(backend="mpi")``; ``shardwise.torch.DistributedOptimizer``
  (default process set: the world of the mpi backend) and the mpi backend's allreduce;
  then ``shardwise.shutdown()``;
* horovod phase: ``shardwise.init(backend="horovod")`` (``hvd.init()``);
  ``horovod.torch.DistributedOptimizer`` / ``hvd.allreduce_`` and
  ``shardwise.torch.DistributedOptimizer`` / the horovod backend's allreduce (both on
  Horovod's engine); then ``shardwise.shutdown()`` (``hvd.shutdown()``).

Tables, each one transport, ratio = shardwise / Horovod within the table only:

* Horovod's engine (over MPI or gloo, as ``hvd.mpi_enabled()`` / ``hvd.gloo_enabled()``
  report at run time): shardwise horovod backend vs Horovod;
* MPI: shardwise mpi backend vs Horovod — only when Horovod runs over MPI; otherwise
  shardwise's mpi rows alone, without a ratio.

Training step: forward + backward + SGD step of an MLP (>= 10M parameters), fresh model
and optimizer per phase, warmed up. Allreduce: algbw (GB/s, in place, float32 sum),
1-64 MiB. Each round's figure is the slowest rank's median over repetitions; the tables
give the median over rounds.
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

from mpi4py import MPI  # noqa: E402 - MPI is initialised (and finalised) by mpi4py, before Horovod

try:
    import horovod
    import horovod.torch as hvd
except ImportError as exc:  # every rank stops the same way
    sys.stderr.write(f"benchmarks/horovod.py needs Horovod built with PyTorch support in this venv "
                     f"(import horovod.torch failed: {exc}). Build it with: bash scripts/horovod/build.sh\n")
    sys.exit(2)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import shardwise  # noqa: E402
import shardwise.torch as swt  # noqa: E402

SIZES_MIB = (1, 4, 16, 64)
HVD = "horovod.torch"
SW_HVD = "shardwise (horovod backend)"
SW_MPI = "shardwise (mpi backend)"


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


def _optimizer(label: str, width: int, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One training step of a fresh model with ``label``'s DistributedOptimizer, warmed up.

    shardwise's optimizer takes the default process set (the world of the backend shardwise
    was initialised with): the mpi backend in the mpi phase, the horovod backend in the other.
    """
    model = _model(width)
    base = torch.optim.SGD(model.parameters(), lr=1e-3)
    if label == HVD:
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=hvd.Average)
    else:
        opt = swt.DistributedOptimizer(base, named_parameters=model.named_parameters())

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # buckets, Horovod's response cache
    return step


def _slowest(mine: dict, rounds: int) -> dict:
    """Per key: the median over rounds of the slowest rank's figure."""
    every = MPI.COMM_WORLD.allgather(mine)
    out = {}
    for k in mine:
        per = [max(r[k][i] for r in every) for i in range(rounds)]
        out[k] = (statistics.median(per), per)
    return out


def _step_table(title: str, steps: dict, rows: list[str], ours: str, peer: str | None, note: str = "") -> None:
    print(f"\n{title}")
    print("| contender | step (ms) | per-round step (ms) |")
    print("|---|---|---|")
    for label in rows:
        t, per = steps[label]
        print(f"| {label} | {t * 1e3:.1f} | " + " ".join(f"{p * 1e3:.1f}" for p in per) + " |")
    if peer is not None:
        print(f"\nratio {ours} / {peer} step time: {steps[ours][0] / steps[peer][0]:.2f}x (< 1: shardwise faster)")
    if note:
        print(note)


def _bw_table(title: str, bw_times: dict, rows: list[str], ours: str, peer: str | None) -> None:
    print(f"\n{title}")
    print("| size | " + " | ".join(rows) + (f" | {ours} / {peer} |" if peer else " |"))
    print("|---" * (len(rows) + 1 + bool(peer)) + "|")
    for mib in SIZES_MIB:
        bw = {k: (mib << 20) / bw_times[(k, mib)][0] / 1e9 for k in rows}
        print(f"| {mib} MiB | " + " | ".join(f"{bw[k]:.2f}" for k in rows)
              + (f" | {bw[ours] / bw[peer]:.2f}x |" if peer else " |"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5, help="timed steps per contender and round (allreduce: 2x)")
    parser.add_argument("--width", type=int, default=2048, help="MLP width (2048: 10.5M parameters)")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    t_start = time.perf_counter()

    raw = MPI.COMM_WORLD
    rank, size = raw.rank, raw.size
    barrier = raw.Barrier  # outside the timed region only
    torch.manual_seed(1 + rank)
    x, y = torch.randn(args.batch, 1024), torch.randint(0, 10, (args.batch,))
    params = sum(p.numel() for p in _model(args.width).parameters())
    labels = (HVD, SW_HVD, SW_MPI)
    buffers = {mib: np.zeros((mib << 20) // 4, dtype=np.float32) for mib in SIZES_MIB}
    tensors = {mib: torch.from_numpy(buffers[mib].copy()) for mib in SIZES_MIB}
    step_times: dict[str, list[float]] = {k: [] for k in labels}
    bw_times: dict[tuple[str, int], list[float]] = {(k, mib): [] for k in labels for mib in SIZES_MIB}
    transports: set[str] = set()

    def measure(steps: dict, reduce: dict) -> None:
        for label, fn in steps.items():
            step_times[label].append(_median(fn, args.reps, barrier))
        for mib in SIZES_MIB:
            for label, fn in reduce.items():
                fn(mib)
                bw_times[(label, mib)].append(_median(lambda: fn(mib), args.reps * 2, barrier))

    for _ in range(args.rounds):
        # mpi phase: shardwise on the mpi backend, Horovod shut down.
        world = shardwise.init(backend="mpi").world
        measure({SW_MPI: _optimizer(SW_MPI, args.width, x, y)},
                {SW_MPI: lambda mib: world.allreduce(buffers[mib], "sum", inplace=True)})
        shardwise.shutdown()
        # horovod phase: Horovod's own optimizer and allreduce, and shardwise on the horovod backend.
        world = shardwise.init(backend="horovod").world
        transports.add(f"mpi_enabled={hvd.mpi_enabled()} gloo_enabled={hvd.gloo_enabled()}")
        measure({label: _optimizer(label, args.width, x, y) for label in (HVD, SW_HVD)},
                {HVD: lambda mib: hvd.allreduce_(tensors[mib], op=hvd.Sum, name=f"bench.{mib}"),
                 SW_HVD: lambda mib: world.allreduce(tensors[mib], "sum", inplace=True, name=f"bench.{mib}")})
        shardwise.shutdown()  # hvd.shutdown(): the next mpi phase runs without Horovod's thread

    steps = _slowest(step_times, args.rounds)
    bws = _slowest(bw_times, args.rounds)
    if rank != 0:
        return
    if len(transports) != 1:
        raise RuntimeError(f"Horovod changed transport between rounds: {sorted(transports)}")
    how = transports.pop()
    on_mpi = "mpi_enabled=True" in how
    engine = f"Horovod {horovod.__version__} engine over {'MPI' if on_mpi else 'gloo'} ({how})"
    mpi_lib = MPI.Get_library_version().split(",")[0].strip()
    print(f"# {size} ranks; median of {args.rounds} rounds (slowest rank per round); "
          f"ratio = shardwise / Horovod, within one table only")
    what = (f"DistributedOptimizer step (forward + backward + SGD), {params / 1e6:.1f}M parameters fp32, "
            f"batch {args.batch}/rank, {args.reps} steps per round")
    _step_table(f"## {what} - transport: {engine}", steps, [HVD, SW_HVD], SW_HVD, HVD)
    if on_mpi:
        _step_table(f"## {what} - transport: MPI ({mpi_lib}; Horovod over MPI)", steps, [HVD, SW_MPI], SW_MPI, HVD)
    else:
        _step_table(f"## {what} - transport: MPI ({mpi_lib})", steps, [SW_MPI], SW_MPI, None,
                    "(no MPI peer in this run: Horovod runs over gloo, so no ratio)")
    what = f"allreduce in place, float32 sum, algbw GB/s, {args.reps * 2} calls per round"
    _bw_table(f"## {what} - transport: {engine}", bws, [HVD, SW_HVD], SW_HVD, HVD)
    if on_mpi:
        _bw_table(f"## {what} - transport: MPI ({mpi_lib}; Horovod over MPI)", bws, [HVD, SW_MPI], SW_MPI, HVD)
    else:
        _bw_table(f"## {what} - transport: MPI ({mpi_lib}; no MPI peer: Horovod runs over gloo)",
                  bws, [SW_MPI], SW_MPI, None)
    print(f"\n# wall {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
