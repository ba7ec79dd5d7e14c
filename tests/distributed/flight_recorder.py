"""Scenarios of the flight recorder: a stalled collective makes every rank dump (run by test_flight_recorder_mp)."""

from __future__ import annotations

import time

import numpy as np

import shardwise


def slow_data_loader(seconds: float) -> None:
    """Where a missing rank spends the stall (its dump must show this frame)."""
    time.sleep(seconds)


def stall(missing: list, stall_s: float, late_s: float) -> None:
    """Every rank but ``missing`` enters allreduce 'stalled'; those come ``late_s`` seconds later.

    With ``stall_timeout=stall_s`` every rank dumps its stacks and rings after about
    ``stall_s`` seconds, and one rank names the missing ones; then the late ranks come
    and the allreduce completes with the right sum, so the job ends normally.
    """
    world = shardwise.init(backend="mpi", stall_timeout=stall_s).world
    x = np.ones(4, dtype=np.float32)
    for step in range(3):
        world.allreduce(x, name=f"warm{step}")
    world.barrier()
    if world.rank == 0:
        print(f"FLIGHT start {time.time():.3f}", flush=True)
    if world.rank in missing:
        slow_data_loader(late_s)
    out = world.allreduce(x, name="stalled")
    if not np.array_equal(out, np.full(4, world.size, dtype=np.float32)):
        raise AssertionError(f"rank {world.rank}: the late allreduce gave {out}")
    world.barrier()
    print(f"FLIGHT done rank {world.rank}", flush=True)
    shardwise.shutdown()
