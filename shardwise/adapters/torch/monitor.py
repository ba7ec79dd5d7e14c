"""The torch side of the comm/compute monitor: one step per ``optimizer.step()``."""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from shardwise.context import current
from shardwise.core.monitor import CommMonitor

__all__ = ["monitor_optimizer", "format_summary"]


def format_summary(monitor: CommMonitor) -> str:
    """A one-line report: step time, compute, exposed and overlapped communication."""
    s = monitor.summary()
    if not s["steps"]:
        return "monitor: no measured step yet"
    n = s["steps"]
    return (f"monitor rank {s['rank']}: {n} steps, {s['step_time_mean'] * 1e3:.1f} ms/step, "
            f"compute {s['compute_time'] / n * 1e3:.1f} ms, comm exposed {s['exposed_comm_time'] / n * 1e3:.1f} ms "
            f"+ overlapped {s['overlapped_comm_time'] / n * 1e3:.1f} ms = {s['fraction']:.0%} of step time, "
            f"{s['bandwidth'] / 1e9:.2f} GB/s")


def monitor_optimizer(optimizer: torch.optim.Optimizer, monitor: Optional[CommMonitor] = None, *,
                      print_every: int = 0, stream: Any = None) -> CommMonitor:
    """Count the time between consecutive ``optimizer.step()`` calls as training steps.

    ``monitor`` defaults to the context's (``shardwise.init(monitor=True)``);
    with ``print_every=N`` rank 0 prints :func:`format_summary` every N steps.
    """
    if monitor is None:
        monitor = current().monitor
        if monitor is None:
            raise RuntimeError("monitoring is off: call shardwise.init(monitor=True) "
                               "or set SHARDWISE_MONITOR=1 / SHARDWISE_TIMELINE=trace.json")
    state = {"last": monitor.now(), "count": 0}

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        now = monitor.now()
        monitor.record_step(state["last"], now)
        state["last"] = now
        state["count"] += 1
        if print_every and state["count"] % print_every == 0 and monitor.rank == 0:
            print(format_summary(monitor), file=stream or sys.stdout, flush=True)

    optimizer.register_step_post_hook(hook)
    return monitor
