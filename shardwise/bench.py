"""Collective micro-benchmarks printed like nccl-tests (size, time, algbw, busbw)."""

from __future__ import annotations

import re
import time
from typing import Callable, Optional, Sequence

import numpy as np

from .core.comm import Communicator

__all__ = ["parse_size", "time_collective", "bus_bandwidth", "allreduce_table"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes in ``4K``, ``1M``, ``64MiB``, ``4096``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use e.g. 4K, 1M, 64M")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def bus_bandwidth(algbw: float, size: int) -> float:
    """nccl-tests' bus bandwidth of an allreduce: algbw x 2(n-1)/n."""
    return algbw * 2 * (size - 1) / size if size > 1 else algbw


def time_collective(comm: Communicator, fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, all ranks starting together each time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # The slowest rank defines the collective's time.
    return float(np.median(comm.allreduce(np.asarray(times), "max")))


def allreduce_table(backend: str = "auto", sizes: Sequence[str] = ("1M",), iters: int = 20,
                    chunk_bytes: Optional[int] = None) -> list[tuple[int, float, float, float]]:
    """Measure in-place float32 allreduce for each size; rank 0 prints the table."""
    import shardwise

    ctx = shardwise.init(backend=backend)
    comm = ctx.world
    if chunk_bytes is not None and hasattr(comm, "chunk_bytes"):
        comm.chunk_bytes = chunk_bytes
    rows = []
    if comm.rank == 0:
        print(f"# shardwise allreduce: backend={ctx.backend} ranks={comm.size} dtype=float32 op=sum in-place")
        print(f"{'size(B)':>12} {'count':>10} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
    for text in sizes:
        nbytes = parse_size(text)
        buf = np.ones(max(1, nbytes // 4), dtype=np.float32)
        seconds = time_collective(comm, lambda: comm.allreduce(buf, "sum", inplace=True), iters)
        algbw = buf.nbytes / seconds / 1e9
        busbw = bus_bandwidth(algbw, comm.size)
        rows.append((buf.nbytes, seconds, algbw, busbw))
        if comm.rank == 0:
            print(f"{buf.nbytes:>12} {buf.size:>10} {seconds * 1e6:>10.1f} {algbw:>12.2f} {busbw:>12.2f}")
    return rows
