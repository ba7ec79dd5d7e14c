"""Peak per-rank memory of one contender, measured the same way for every contender.

CPU: a freed tensor must leave the resident set at once, or the next contender's
peak starts from memory the allocator kept. The memory phase runs before the timing
(see ``_common.memory_phase``) and first calls :func:`return_freed_memory`,
which sets glibc's mmap threshold to 64 KiB at run time (``mallopt``; every larger
block is then its own mapping, unmapped when freed) and trims the heap. Then, per
contender: ``gc.collect()``; reset the resident-set high-water mark (``"5"`` into
``/proc/self/clear_refs``); baseline = ``VmRSS``; build the contender (model copy +
optimizer / wrapper) and run its steps; peak = ``VmHWM`` - baseline.
CUDA: ``torch.cuda.reset_peak_memory_stats`` and ``max_memory_allocated`` - baseline.
The caller deletes the contender and collects garbage before the next one, and calls
:func:`restore_allocator` when its memory phase is over, so that the next table is timed
with the allocator settings a training process reaches on its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Any, Callable

MMAP_THRESHOLD = 65536
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
#: glibc's ceiling for its self-adjusting mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX);
#: the trim threshold follows at twice the mmap threshold.
_DYNAMIC_MMAP_MAX = 32 << 20


def _malloc_calls() -> Any:
    """glibc's ``mallopt`` and ``malloc_trim``, or None for another C library."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> bool:
    """From now on, hand freed blocks of 64 KiB or more back to the system at once; trim the heap.

    Called for a memory phase, never for timing: a mapping per large block makes
    every allocation fault its pages in, which slows a training step by a third on a CPU.
    Returns False where the C library is not glibc (the peaks then include reused heap).
    """
    calls = _malloc_calls()
    if calls is None:
        return False
    mallopt, malloc_trim = calls
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD))
    gc.collect()
    malloc_trim(0)
    return ok


def timing_allocator(memory_phase: bool) -> str:
    """How the benchmark header names the allocator the timing runs with."""
    if memory_phase:
        return ("every table's memory phase (64 KiB mmap threshold) before any timing (timing with glibc's "
                "mmap threshold fixed at its 32 MiB ceiling, trim threshold 64 MiB)")
    return "no memory phase (timing with the allocator's own defaults)"


def restore_allocator() -> None:
    """Undo :func:`return_freed_memory` for the timing that follows a memory phase.

    glibc raises its mmap threshold by itself as a process frees large blocks, up to
    32 MiB; once ``mallopt`` has set it, it no longer moves, so it is set to where a
    training process that frees tensors of up to 32 MiB ends up. Left at 64 KiB, every
    later table was timed with a mapping per tensor: 30-50 % slower steps on a CPU.
    """
    calls = _malloc_calls()
    if calls is not None:
        mallopt, _ = calls
        mallopt(_M_MMAP_THRESHOLD, _DYNAMIC_MMAP_MAX)
        mallopt(_M_TRIM_THRESHOLD, 2 * _DYNAMIC_MMAP_MAX)


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


def start_on_every_rank(world: Any) -> int:
    """Hand freed memory back, reset the high-water mark on every rank of ``world`` together, and
    return this rank's resident set: the baseline a job's ``status("VmHWM")`` is measured above."""
    import gc

    return_freed_memory()
    gc.collect()
    world.barrier()
    reset_peak()
    return status("VmRSS")


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
        return_freed_memory()
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
