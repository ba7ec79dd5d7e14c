"""Peak per-rank memory of one contender, measured the same way for every contender.

CPU: glibc must hand freed blocks back to the system at once, or a freed tensor stays
in the resident set and the next contender's peak starts from it; the benchmarks call
:func:`ensure_mmap_threshold` first thing (it re-executes the process with
``MALLOC_MMAP_THRESHOLD_=65536`` when that is not set; glibc reads it at start-up).
Then, per contender: ``gc.collect()``; reset the resident-set high-water mark
(``"5"`` into ``/proc/self/clear_refs``); baseline = ``VmRSS``; build the contender
(model copy + optimizer / wrapper) and run its steps; peak = ``VmHWM`` - baseline.
CUDA: ``torch.cuda.reset_peak_memory_stats`` and ``max_memory_allocated`` - baseline.
The caller deletes the contender and collects garbage before the next one.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any, Callable

MMAP_THRESHOLD = "65536"


def ensure_mmap_threshold() -> None:
    """Re-execute this process with ``MALLOC_MMAP_THRESHOLD_`` set (before MPI or torch start up).

    Under ``mpirun`` each rank re-executes itself in place (same pid), before ``MPI_Init``.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable] + sys.argv, env)


def status(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Reset this process's resident-set high-water mark (``VmHWM``) to its current resident set."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")


def peak_bytes(build: Callable[[], Callable[[], Any]], steps: int = 3, device: str = "cpu") -> int:
    """Peak memory above the baseline while ``build()`` makes a step function and ``steps`` steps run.

    ``build`` creates the contender (model copy, optimizer, wrapper) and returns its step
    function; everything it made is dropped when this returns.
    """
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reset_peak()
        base = status("VmRSS")
    step = build()
    for _ in range(steps):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = status("VmHWM") - base
    del step
    gc.collect()
    return peak
