"""Allreduce bandwidth: shardwise (mpi backend) vs raw mpi4py vs torch.distributed gloo.

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/allreduce.py
All three run in the same job, interleaved size by size and round by round, so
machine noise hits them alike; each figure is the median over rounds of the
median over iterations. Prints algbw (GB/s) for each and the ratio shardwise/mpi4py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import shardwise
from shardwise.bench import parse_size

SIZES = ["4K", "64K", "1M", "4M", "16M", "64M"]


def _median_time(fn, iters: int, barrier) -> float:
    fn()
    times = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=SIZES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--chunk-sweep", action="store_true", help="also time shardwise at several piece sizes")
    parser.add_argument("--no-gloo", action="store_true")
    args = parser.parse_args()

    comm = shardwise.init(backend="mpi").world
    raw = MPI.COMM_WORLD
    gloo = None
    if not args.no_gloo:
        import torch
        import torch.distributed as dist

        url = raw.bcast(f"tcp://127.0.0.1:{29400 + os.getpid() % 500}" if raw.rank == 0 else None)
        dist.init_process_group("gloo", init_method=url, rank=raw.rank, world_size=raw.size)
        gloo = dist
    chunks = [1 << 20, 2 << 20, 4 << 20, 8 << 20, 0] if args.chunk_sweep else []
    default_chunk = comm.chunk_bytes
    rows = []
    for text in args.sizes:
        nbytes = parse_size(text)
        a = np.ones(nbytes // 4, dtype=np.float32)
        results: dict[str, list[float]] = {"shardwise": [], "mpi4py": [], "gloo": []}
        results.update({f"chunk={c >> 20}M" if c else "chunk=off": [] for c in chunks})
        for _ in range(args.rounds):
            comm.chunk_bytes = default_chunk
            results["shardwise"].append(_median_time(lambda: comm.allreduce(a, "sum", inplace=True),
                                                     args.iters, raw.Barrier))
            results["mpi4py"].append(_median_time(lambda: raw.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM),
                                                  args.iters, raw.Barrier))
            if gloo is not None:
                t = torch.from_numpy(a)
                results["gloo"].append(_median_time(lambda: gloo.all_reduce(t), args.iters, raw.Barrier))
            for c in chunks:
                comm.chunk_bytes = c
                key = f"chunk={c >> 20}M" if c else "chunk=off"
                results[key].append(_median_time(lambda: comm.allreduce(a, "sum", inplace=True),
                                                 args.iters, raw.Barrier))
        comm.chunk_bytes = default_chunk
        # The slowest rank defines a collective's time.
        med = {k: raw.allreduce(statistics.median(v), op=MPI.MAX) for k, v in results.items() if v}
        rows.append((nbytes, {k: nbytes / v / 1e9 for k, v in med.items()}))
    if raw.rank == 0:
        keys = list(rows[0][1])
        print(f"# allreduce float32 sum in place, {raw.size} ranks, {MPI.Get_library_version().splitlines()[0]}")
        print(f"# shardwise piece size {default_chunk >> 20} MiB; algbw in GB/s; median of {args.rounds} rounds")
        print("| size | " + " | ".join(keys) + " | shardwise/mpi4py | shardwise/gloo |")
        print("|---" * (len(keys) + 3) + "|")
        for nbytes, bw in rows:
            size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            ratio_gloo = f"{bw['shardwise'] / bw['gloo']:.2f}x" if "gloo" in bw else "-"
            print(f"| {size} | " + " | ".join(f"{bw[k]:.2f}" for k in keys)
                  + f" | {bw['shardwise'] / bw['mpi4py']:.2f}x | {ratio_gloo} |")
    if gloo is not None:
        gloo.destroy_process_group()


if __name__ == "__main__":
    main()
