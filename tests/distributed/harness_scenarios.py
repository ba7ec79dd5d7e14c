"""Scenarios that exercise the test harness itself (tests/mpi_harness.py): no framework, no shardwise state."""

from __future__ import annotations

import os
import time


def report(tag: str) -> None:
    """Print this rank's tag and process id."""
    print(f"tag={tag} rank={os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMI_RANK', '?'))} "
          f"pid={os.getpid()}", flush=True)


def fail_on(rank: int) -> None:
    """Raise on ``rank``; the other ranks would wait forever for it without the runner's abort."""
    if int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))) == rank:
        raise ValueError(f"scenario failed on rank {rank} on purpose")
    time.sleep(600)


def hang() -> None:
    """Report this rank, then never return."""
    report("hang")
    time.sleep(600)
