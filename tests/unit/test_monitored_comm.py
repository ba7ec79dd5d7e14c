"""MonitoredCommunicator records blocking and async collectives for the monitor."""

import json
import time

import numpy as np

from shardwise.backends.local import LocalCommunicator
from shardwise.backends.monitored import MonitoredCommunicator, nbytes_of
from shardwise.core.monitor import CommMonitor


def test_records_blocking_and_async_collectives(tmp_path):
    trace = tmp_path / "trace.json"
    mon = CommMonitor(rank=0, warmup_steps=0, warn_threshold=None, timeline=str(trace))
    comm = MonitoredCommunicator(LocalCommunicator(), mon)
    x = np.ones(256, np.float32)
    with mon.step():
        time.sleep(0.01)
        comm.allreduce(x, "sum", name="grads")
        comm.allgather_async(x).wait()
        sub = comm.split(color=0)
        sub.broadcast(x)
    s = mon.summary()
    assert s["steps"] == 1 and s["bytes"] == 3 * x.nbytes
    assert set(s["collectives"]) == {"allreduce.grads", "allgather", "broadcast"}
    assert 0 <= s["fraction"] < 0.5 and s["compute_time"] >= 0.01
    mon.close()
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert {e["name"] for e in events} >= {"allreduce.grads", "allgather", "broadcast"}


def test_nbytes_of():
    import torch

    assert nbytes_of(np.zeros(3, np.float64)) == 24
    assert nbytes_of(torch.zeros(5, dtype=torch.bfloat16)) == 10
    assert nbytes_of(object()) == 0
