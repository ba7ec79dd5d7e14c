"""Does a non-blocking MPI all-gather overlap with compute that makes no MPI call? (raw mpi4py)

    shardwise run -np 4 -- python benchmarks/mpi_gather_overlap.py

The question behind Keras ZeRO-3 on JAX, whose gathers are host callbacks inside the
compiled step: would starting the next layer's gather one layer early (``Iallgather``)
hide it behind the current layer's compute? Each round times three variants per step:
``Allgather`` then compute; ``Iallgather``, compute, ``Wait``; and each part alone.
Medians over rounds, rank 0 printing; what an overlap can save is at most the
all-gather alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layer-mib", type=int, default=16, help="gathered size of one layer")
    parser.add_argument("--rows", type=int, default=512, help="rows of the compute's (rows x 2048) @ (2048 x 2048)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    shard = np.ones((args.layer_mib << 18) // comm.size, np.float32)
    out = np.empty(shard.size * comm.size, np.float32)
    rng = np.random.default_rng(comm.rank)
    a = rng.random((args.rows, 2048), dtype=np.float32)
    b = rng.random((2048, 2048), dtype=np.float32)

    def compute() -> None:
        for _ in range(3):
            a @ b

    def sequential() -> None:
        comm.Allgather(shard, out)
        compute()

    def overlapped() -> None:
        request = comm.Iallgather(shard, out)
        compute()
        request.Wait()

    variants = {"Allgather, then compute": sequential, "Iallgather, compute, Wait": overlapped,
                "compute alone": compute, "Allgather alone": lambda: comm.Allgather(shard, out)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, step in variants.items():  # interleaved round by round
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            elapsed = comm.allreduce((time.perf_counter() - start) / args.steps, op=MPI.MAX)
            times[name].append(elapsed)
    if comm.rank == 0:
        print(f"mpi_gather_overlap: {comm.size} ranks, {MPI.Get_library_version().splitlines()[0]}, layer "
              f"{args.layer_mib} MiB gathered, compute 3 x ({args.rows}x2048 @ 2048x2048), {args.steps} steps x "
              f"{args.rounds} rounds (median, slowest rank)")
        for name, values in times.items():
            print(f"{name:28s} {statistics.median(values) * 1e3:8.1f} ms/step")
        ratio = statistics.median(times["Iallgather, compute, Wait"]) / statistics.median(
            times["Allgather, then compute"])
        print(f"ratio overlapped / sequential: {ratio:.2f}x")


if __name__ == "__main__":
    main()
