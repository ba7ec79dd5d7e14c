"""Shared pieces of the torch benchmarks: process set-up, interleaved timing, memory phase, tables.

A benchmark defines its contenders as ``name -> build`` where ``build()`` makes a fresh
contender (model copy + optimizer / wrapper) and returns its step function. Then:

* :func:`time_interleaved` builds them all, warms each up, and times them round by round
  (every contender once per round, ``steps`` steps each, a barrier before every step);
  a round's figure is the median step of the slowest rank, the result the median over rounds;
  each step's CPU time (``time.process_time``: every thread of the process, so the
  backend's communication threads too) is taken the same way;
* :func:`memory_phase`, before the timing, builds them one at a time and measures each one's
  peak per-rank memory with :func:`_peak.peak_bytes` (the largest rank), after an unmeasured
  pass over all of them that takes every first-time cost (lazy imports, kernel selection,
  thread pools) off the rows;
* :func:`run_transports` runs a whole benchmark that way: every table's memory phase first,
  one transport (shardwise backend) at a time, then every table's timing;
* :func:`print_results` prints one table per transport and the ratios shardwise / peer
  (time and memory; < 1 means shardwise is faster or smaller). Ratios are only ever taken
  between two rows of the same table, i.e. the same transport.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

Build = Callable[[], Callable[[], Any]]


class Row(tuple):
    """A contender's figures ``(median step s, per-round step s, peak bytes or None)``.

    ``cpu`` is the median CPU seconds per step of the busiest rank (None: not measured).
    It counts every thread of the rank's process, so a backend's communication threads
    too: with one core per rank, a step cannot take less wall time than that.
    """

    def __new__(cls, step: float, per_round: list[float], peak: Optional[int],
                cpu: Optional[float] = None) -> "Row":
        row = super().__new__(cls, (step, per_round, peak))
        row.cpu = cpu
        return row


#: ``name -> Row`` (or a plain ``(median step s, per-round step s, peak bytes or None)``)
Results = dict[str, tuple[float, list[float], Optional[int]]]


def set_threads(ranks_per_node: Optional[int] = None) -> int:
    """One share of the cores per rank (at least one thread); returns the thread count."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = ranks_per_node or int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    torch.set_num_threads(max(1, cores // local))
    return torch.get_num_threads()


def init_gloo() -> Any:
    """shardwise on the torch backend: ``shardwise.init(backend="torch")`` builds the gloo group.

    Under ``shardwise run`` (mpirun) rank 0's address reaches the others over MPI; the world
    returned is a TorchCommunicator. MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE are set
    afterwards, for peers (DeepSpeed) that read them; the group itself is already up.
    """
    import shardwise
    import torch.distributed as dist

    world = shardwise.init(backend="torch").world
    os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world.size), LOCAL_RANK=str(world.rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    assert dist.get_backend() in ("gloo", "nccl")
    return world


def median_wall_and_cpu(comm: Any, fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """This rank's median wall and CPU seconds of ``fn`` (all threads), every rank starting each call together."""
    walls, cpus = [], []
    for _ in range(calls):
        comm.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def median_call(comm: Any, fn: Callable[[], Any], calls: int) -> float:
    """This rank's median seconds of ``fn`` over ``calls`` calls, every rank starting each call together."""
    return median_wall_and_cpu(comm, fn, calls)[0]


def time_interleaved(builds: dict[str, Build], comm: Any, rounds: int, steps: int,
                     warmup: int = 2) -> dict[str, tuple[float, list[float], float]]:
    """``name -> (median over rounds, per-round figures, median CPU s per step)``.

    A round's figure is the slowest rank's median step, and its CPU figure the busiest rank's.
    """
    fns = {}
    for name, build in builds.items():
        fns[name] = build()
        for _ in range(warmup):  # lazy optimizer state, buckets, JIT-compiled ops, shape inference
            fns[name]()
    mine: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            mine[name].append(median_wall_and_cpu(comm, fn, steps))
    fns.clear()
    gc.collect()
    every = comm.allgather_object(mine)
    out = {}
    for name in mine:
        per_round = [max(rank[name][r][0] for rank in every) for r in range(rounds)]
        cpu = [max(rank[name][r][1] for rank in every) for r in range(rounds)]
        out[name] = (statistics.median(per_round), per_round, statistics.median(cpu))
    return out


def memory_phase(builds: dict[str, Build], comm: Any, steps: int = 3, device: str = "cpu") -> dict[str, int]:
    """Peak bytes per contender (largest rank), one contender at a time; the allocator is restored after.

    Run it before any timing: measured after the timing phase (every contender built and
    stepped at once), the same contender's peak moved by tens of MiB from run to run, and
    FSDP2's read 796 MiB where one contender per fresh process reads 205. Every contender is
    first built and stepped once unmeasured; the measured pass matches one contender per
    fresh process within 0.5 MiB.
    """
    from _peak import peak_bytes, restore_allocator

    peaks = {}
    try:
        for build in builds.values():
            comm.barrier()
            peak_bytes(build, steps, device)
            gc.collect()
        for name, build in builds.items():
            comm.barrier()
            peak = peak_bytes(build, steps, device)
            peaks[name] = max(comm.allgather_object(peak))
            gc.collect()
    finally:
        restore_allocator()
    return peaks


@dataclass
class Transport:
    """The tables of one shardwise backend: ``"torch"`` (the gloo group every peer shares) or ``"mpi"``.

    ``tables(world)`` makes ``table key -> contenders`` for the world just opened (called
    once for the memory phases, once for the timing); ``report(world, results)`` gets
    ``table key -> Results`` and prints them; ``opened(world)``, if given, runs right after
    the backend comes up (DeepSpeed adopting the gloo group), ``closing()`` right before it
    is shut down (DeepSpeed letting go of the groups it cached).
    """

    backend: str
    tables: Callable[[Any], dict[str, dict[str, Build]]]
    report: Callable[[Any, dict[str, Results]], None]
    opened: Optional[Callable[[Any], None]] = None
    closing: Optional[Callable[[], None]] = None

    def open(self) -> Any:
        import shardwise

        world = init_gloo() if self.backend == "torch" else shardwise.init(backend=self.backend).world
        if self.opened is not None:
            self.opened(world)
        return world

    def close(self) -> None:
        import shardwise

        if self.closing is not None:
            self.closing()
        shardwise.shutdown()


def run_transports(transports: Sequence[Transport], rounds: int, steps: int, memory: bool = True) -> None:
    """Every table's memory phase, transport by transport; then every table's timing and report.

    No memory phase comes after any timing: measured after another table's timing in the
    same process, the GPT's ZeRO peaks read 110-160 MiB higher (317.8 MiB for ZeRO-1
    against 174.8 measured first). Each transport's backend is opened for its phase and
    shut down after it, so a run opens each one twice.
    """
    peaks: dict[tuple[str, str], dict[str, int]] = {}
    if memory:
        for transport in transports:
            world = transport.open()
            for key, builds in transport.tables(world).items():
                peaks[transport.backend, key] = memory_phase(builds, world)
            transport.close()
    for transport in transports:
        world = transport.open()
        results = {}
        for key, builds in transport.tables(world).items():
            mem = peaks.get((transport.backend, key), {})
            results[key] = {name: Row(t, per, mem.get(name), *cpu)
                            for name, (t, per, *cpu) in time_interleaved(builds, world, rounds, steps).items()}
        transport.report(world, results)
        transport.close()


def paired_ratios(ours: Sequence[float], peer: Sequence[float]) -> str:
    """Round-by-round ratios of two interleaved contenders: median (range) and how many rounds ``ours`` won.

    Round k of both ran back to back, on the host as it was then, so the paired ratio
    does not carry the drift between rounds that the ratio of the two medians does.
    """
    ratios = sorted(a / b for a, b in zip(ours, peer) if b > 0)
    if not ratios:
        return "n/a"
    faster = sum(r < 1.0 for r in ratios)
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}), {faster}/{len(ratios)}"


def print_results(title: str, results: Results,
                  pairs: Sequence[tuple[str, str]] = (), items: int = 0, unit: str = "samples/s",
                  extra: Optional[dict[str, str]] = None, extra_header: str = "",
                  missing: Optional[dict[str, str]] = None, floor: Optional[str] = None) -> None:
    """One transport's table and, for each (shardwise row, peer row) in ``pairs``, the ratios.

    ``missing`` names contenders that could not run, with the reason, shown as rows too.
    ``floor`` names the row that communicates nothing: each ratio then also shows the
    floor's step over the peer's, the lowest step time ratio any library could reach.
    """
    print(f"\n{title}")
    with_cpu = any(getattr(row, "cpu", None) is not None for row in results.values())
    head = "| contender | step (ms) | " + ("CPU ms/step (max rank) | " if with_cpu else "") \
           + (f"{unit} | " if items else "") + "peak MiB (max rank) | " \
           + (f"{extra_header} | " if extra_header else "") + "per-round step (ms) |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, row in results.items():
        t, per, peak = row
        cpu = getattr(row, "cpu", None)
        cells = [name, f"{t * 1e3:.1f}"] + (["n/a" if cpu is None else f"{cpu * 1e3:.1f}"] if with_cpu else [])
        cells += [f"{items / t:.0f}"] if items else []
        cells.append("n/a" if peak is None else f"{peak / 2**20:.1f}")
        if extra_header:
            cells.append((extra or {}).get(name, ""))
        cells.append(" ".join(f"{p * 1e3:.1f}" for p in per))
        print("| " + " | ".join(cells) + " |")
    for name, why in (missing or {}).items():
        print(f"| {name} | {why} |" + " |" * (head.count("|") - 3))
    rows = [(a, b) for a, b in pairs if a in results and b in results]
    if rows:
        bound = results[floor][0] if floor in results else None
        header = ["shardwise", "peer (same transport)", "step time ratio",
                  "per-round ratio: median (range), rounds faster", "peak memory ratio"]
        note = ("ratio = shardwise / peer: < 1 means shardwise is faster / uses less memory; the step time "
                "ratio divides the two medians, the per-round ratio pairs the rounds, which ran interleaved")
        if bound:
            header.append("floor / peer")
            note += ("; floor / peer: the floor row's step over the peer's, the lowest step time ratio any "
                     "library could reach on this host")
        print("\n| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for ours, peer in rows:
            (t0, per0, m0), (t1, per1, m1) = results[ours], results[peer]
            cells = [ours, peer, f"{t0 / t1:.2f}x", paired_ratios(per0, per1),
                     f"{m0 / m1:.2f}x" if m0 and m1 else "n/a"] + ([f"{bound / t1:.2f}x"] if bound else [])
            print("| " + " | ".join(cells) + " |")
        print(f"({note})")
