"""Scenarios that exercise the test harness itself (tests/mpi_harness.py): no framework, no shardwise state."""

from __future__ import annotations

import os
import time

from _runner import _rank


def report(tag: str) -> None:
    """Print this rank's tag and process id."""
    print(f"tag={tag} rank={_rank()} pid={os.getpid()}", flush=True)


def fail_on(rank: int) -> None:
    """Raise on ``rank``; the other ranks would wait forever for it without the runner's abort."""
    if _rank() == rank:
        raise ValueError(f"scenario failed on rank {rank} on purpose")
    time.sleep(600)


def hang() -> None:
    """Report this rank, then never return."""
    report("hang")
    time.sleep(600)
