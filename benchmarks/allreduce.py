"""Allreduce bandwidth, one table per transport: MPI (shardwise mpi backend vs raw mpi4py),
gloo (shardwise torch backend vs raw ``torch.distributed.all_reduce``).

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/allreduce.py

One job, two phases, never a ratio across them:

* MPI: ``shardwise.init(backend="mpi")``; shardwise's ``allreduce(inplace=True)`` on a numpy
  buffer vs ``MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, ...)`` on the same buffer
  (``--chunk-sweep`` adds shardwise at 1/2/4/8 MiB pieces and unchunked);
* gloo: ``shardwise.shutdown()``, then ``shardwise.init(backend="torch")`` (a
  TorchCommunicator over a gloo process group, as benchmarks/_common.py sets up);
  shardwise's ``allreduce(inplace=True)`` on a torch tensor vs ``torch.distributed.all_reduce``
  of the same tensor on the same gloo group.

Within a phase the contenders are interleaved size by size and round by round (each
contender ``--iters`` timed calls per round, a barrier before each), so machine noise hits
them alike. A round's figure is the median call of the slowest rank; the table gives the
median over rounds as algbw (bytes / time, GB/s) and the ratio shardwise / peer algbw
(> 1: shardwise is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

import shardwise
from shardwise.bench import parse_size

from _common import median_call

SIZES = ["4K", "64K", "1M", "4M", "16M", "64M"]
CHUNKS = [1 << 20, 2 << 20, 4 << 20, 8 << 20, 0]

# name -> (set-up run before the contender's timed calls of a round, or None; the timed call)
Contenders = dict[str, tuple[Optional[Callable[[], None]], Callable[[], Any]]]


def _interleaved(contenders: Contenders, world: Any, rounds: int, iters: int) -> dict[str, float]:
    """``name -> median over rounds`` of the slowest rank's median call (seconds)."""
    for setup, fn in contenders.values():  # warm-up: buffers, connections, Open MPI's tuned choice
        if setup:
            setup()
        fn()
    mine: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, (setup, fn) in contenders.items():
            if setup:
                setup()
            mine[name].append(median_call(world, fn, iters))
    every = world.allgather_object(mine)
    return {name: statistics.median(max(rank[name][r] for rank in every) for r in range(rounds))
            for name in mine}


def _gbs(v: float) -> str:
    return f"{v:.2f}" if v >= 0.1 else f"{v:.3g}"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _print(title: str, rows: list[tuple[int, dict[str, float]]], ours: str, peer: str) -> None:
    keys = list(rows[0][1])
    print(f"\n{title}")
    print("| size | " + " | ".join(keys) + f" | {ours} / {peer} |")
    print("|---" * (len(keys) + 2) + "|")
    for nbytes, bw in rows:
        print(f"| {_size(nbytes)} | " + " | ".join(_gbs(bw[k]) for k in keys)
              + f" | {bw[ours] / bw[peer]:.2f}x |")
    sys.stdout.flush()


def mpi_phase(args: argparse.Namespace) -> tuple[list, str]:
    """shardwise mpi backend vs raw mpi4py ``Allreduce`` (MPI shared memory)."""
    world = shardwise.init(backend="mpi").world
    raw = MPI.COMM_WORLD
    default_chunk = world.chunk_bytes

    def chunk(c: int) -> Callable[[], None]:
        def setup() -> None:
            world.chunk_bytes = c
        return setup

    rows = []
    for text in args.sizes:
        nbytes = parse_size(text)
        a = np.zeros(nbytes // 4, dtype=np.float32)
        contenders: Contenders = {
            "shardwise (mpi backend)": (chunk(default_chunk), lambda: world.allreduce(a, "sum", inplace=True)),
            "mpi4py Allreduce": (None, lambda: raw.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)),
        }
        if args.chunk_sweep:
            for c in CHUNKS:
                contenders[f"shardwise chunk={c >> 20}M" if c else "shardwise chunk=off"] = \
                    (chunk(c), lambda: world.allreduce(a, "sum", inplace=True))
        med = _interleaved(contenders, world, args.rounds, args.iters)
        rows.append((nbytes, {k: nbytes / v / 1e9 for k, v in med.items()}))
    world.chunk_bytes = default_chunk
    what = (f"## transport: MPI ({MPI.Get_library_version().split(',')[0].strip()}); "
            f"shardwise piece size {default_chunk >> 20} MiB")
    shardwise.shutdown()
    return rows, what


def gloo_phase(args: argparse.Namespace) -> tuple[list, str]:
    """shardwise torch backend vs raw ``torch.distributed.all_reduce``, both on one gloo group."""
    import torch
    import torch.distributed as dist

    world = shardwise.init(backend="torch").world
    group = world.process_group
    backend = dist.get_backend(group)
    rows = []
    for text in args.sizes:
        nbytes = parse_size(text)
        t = torch.zeros(nbytes // 4, dtype=torch.float32)
        contenders: Contenders = {
            "shardwise (torch backend)": (None, lambda: world.allreduce(t, "sum", inplace=True)),
            "torch.distributed.all_reduce": (None, lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)),
        }
        med = _interleaved(contenders, world, args.rounds, args.iters)
        rows.append((nbytes, {k: nbytes / v / 1e9 for k, v in med.items()}))
    what = f"## transport: {backend} (torch.distributed {torch.__version__}, one process group for both rows)"
    shardwise.shutdown()
    return rows, what


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=SIZES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10, help="timed calls per contender, size and round")
    parser.add_argument("--chunk-sweep", action="store_true",
                        help="MPI table: also time shardwise at 1/2/4/8 MiB pieces and unchunked")
    parser.add_argument("--no-mpi", action="store_true", help="skip the MPI table")
    parser.add_argument("--no-gloo", action="store_true", help="skip the gloo table")
    args = parser.parse_args()
    rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    if rank == 0:
        print(f"# allreduce, float32 sum, in place, {size} ranks; algbw GB/s (bytes / time); median of "
              f"{args.rounds} rounds x {args.iters} calls (slowest rank per round); ratio = shardwise / peer "
              "algbw, same table only (> 1: shardwise faster)")
        sys.stdout.flush()
    if not args.no_mpi:
        t0 = time.perf_counter()
        rows, what = mpi_phase(args)
        if rank == 0:
            _print(f"{what} [{time.perf_counter() - t0:.0f} s]", rows, "shardwise (mpi backend)", "mpi4py Allreduce")
    if not args.no_gloo:
        t0 = time.perf_counter()
        rows, what = gloo_phase(args)
        if rank == 0:
            _print(f"{what} [{time.perf_counter() - t0:.0f} s]", rows, "shardwise (torch backend)",
                   "torch.distributed.all_reduce")


if __name__ == "__main__":
    main()
