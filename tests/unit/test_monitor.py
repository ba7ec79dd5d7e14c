"""Communication/compute accounting and the Chrome trace writer, driven by synthetic events."""

import json
import os
import warnings

import pytest

from shardwise.core.comm import Handle
from shardwise.core.errors import ConfigError
from shardwise.core.monitor import TIMELINE_ENV, CommMonitor, Timeline, scaling_efficiency


@pytest.fixture(autouse=True)
def _no_env_timeline(monkeypatch):
    monkeypatch.delenv(TIMELINE_ENV, raising=False)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def monitor(**kw):
    kw.setdefault("warmup_steps", 0)
    kw.setdefault("warn_threshold", None)
    return CommMonitor(**kw)


def test_blocking_collectives_are_exposed():
    mon = monitor()
    mon.record_collective("allreduce", 100, 2.0, 4.0)
    mon.record_collective("allreduce", 50, 6.0, 7.0)
    step = mon.record_step(0.0, 10.0)
    assert (step.comm_time, step.exposed_comm_time, step.overlapped_comm_time) == (3.0, 3.0, 0.0)
    assert step.compute_time == 7.0 and step.fraction == pytest.approx(0.3) and step.nbytes == 150
    assert mon.fraction == pytest.approx(0.3)


def test_async_collective_overlaps_compute():
    mon = monitor()
    mon.record_collective("allgather", 8, 1.0, 5.0, wait_start=4.0)  # issued at 1, waited from 4
    step = mon.record_step(0.0, 10.0)
    assert step.comm_time == 4.0 and step.exposed_comm_time == 1.0 and step.overlapped_comm_time == 3.0
    mon.record_collective("allgather", 8, 11.0, 12.0, wait_start=13.0)  # done before the wait
    assert mon.record_step(10.0, 20.0).exposed_comm_time == 0.0


def test_concurrent_collectives_are_not_double_counted():
    mon = monitor()
    mon.record_collective("a", 1, 1.0, 3.0)
    mon.record_collective("b", 1, 2.0, 4.0)
    assert mon.record_step(0.0, 10.0).comm_time == pytest.approx(3.0)


def test_collective_spanning_steps_is_clipped_and_carried():
    mon = monitor()
    mon.record_collective("rs", 4, 8.0, 12.0, wait_start=11.0)
    first, second = mon.record_step(0.0, 10.0), mon.record_step(10.0, 20.0)
    assert (first.comm_time, first.exposed_comm_time) == (2.0, 0.0)
    assert (second.comm_time, second.exposed_comm_time) == (2.0, 1.0)
    mon.record_collective("between", 4, 20.5, 20.7)  # outside any step: not in the fractions
    assert mon.record_step(21.0, 22.0).comm_time == 0.0
    assert mon.summary()["collectives"]["between"]["count"] == 1


def test_context_managers_with_a_clock():
    clock = FakeClock()
    mon = monitor(clock=clock)
    with mon.step():
        clock.t += 1.0  # compute
        with mon.collective("allreduce.grads", 1024):
            clock.t += 0.5
        clock.t += 0.5
    (step,) = mon.steps
    assert (step.start, step.end, step.exposed_comm_time, step.nbytes) == (0.0, 2.0, 0.5, 1024)
    with pytest.raises(ConfigError, match="cannot nest"):
        with mon.step():
            with mon.step():
                pass


def test_track_wraps_an_async_handle():
    clock = FakeClock()

    class Pending(Handle):
        def wait(self, timeout=None):
            clock.t += 0.25  # blocks a little
            return "result"

        def done(self):
            return False

    mon = monitor(clock=clock)
    with mon.step():
        handle = mon.track("allgather.params", 64, Pending())
        clock.t += 1.0  # compute while the collective runs
        assert handle.wait() == "result" and not handle.done()
        handle.wait()  # a second wait records nothing
    (step,) = mon.steps
    assert step.comm_time == pytest.approx(1.25) and step.exposed_comm_time == pytest.approx(0.25)
    assert mon.summary()["collectives"]["allgather.params"]["count"] == 1


def test_warns_once_above_threshold_after_warmup():
    mon = CommMonitor(warn_threshold=0.2, warmup_steps=1)
    mon.record_collective("x", 1, 0.0, 9.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.record_step(0.0, 10.0)  # warm-up: 90% but not measured
        mon.record_collective("x", 1, 10.0, 11.0)
        mon.record_step(10.0, 20.0)  # 10%
    mon.record_collective("x", 1, 20.0, 26.0)
    with pytest.warns(RuntimeWarning, match=r"communication is 35% of step time \(threshold 20%\)"):
        mon.record_step(20.0, 30.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.record_collective("x", 1, 30.0, 39.0)
        mon.record_step(30.0, 40.0)  # warned already


def test_summary():
    mon = CommMonitor(warn_threshold=None, warmup_steps=1)
    mon.record_step(0.0, 100.0)  # warm-up
    mon.record_collective("allreduce", 1000, 101.0, 102.0, wait_start=101.5)
    mon.record_collective("allgather", 3000, 103.0, 104.0)
    mon.record_step(100.0, 110.0)
    s = mon.summary()
    assert (s["steps"], s["warmup_steps"], s["step_time_total"], s["bytes"]) == (1, 1, 10.0, 4000)
    assert (s["comm_time"], s["exposed_comm_time"], s["overlapped_comm_time"]) == (2.0, 1.5, 0.5)
    assert s["compute_time"] == 8.5 and s["fraction"] == pytest.approx(0.15) and s["bandwidth"] == 2000.0
    assert s["collectives"]["allreduce"] == {"count": 1, "bytes": 1000, "time": 1.0, "exposed_time": 0.5}
    json.dumps(s)


@pytest.mark.parametrize("args, message", [
    (("x", 1, 2.0, 1.0), "need end >= start"), (("x", -1, 0.0, 1.0), "nbytes"),
])
def test_bad_events(args, message):
    with pytest.raises(ConfigError, match=message):
        monitor().record_collective(*args)
    with pytest.raises(ConfigError, match="before its start"):
        monitor().record_step(2.0, 1.0)
    with pytest.raises(ConfigError, match="warn_threshold"):
        CommMonitor(warn_threshold=2.0)


def test_timeline_writes_chrome_trace(tmp_path):
    path = tmp_path / "trace3.json"
    mon = monitor(rank=3, timeline=Timeline(tmp_path / "trace{rank}.json", rank=3))
    assert not path.exists()
    mon.record_collective("allreduce.grads", 4096, 0.001, 0.0015)
    mon.record_step(0.0, 0.002)
    mon.close()
    mon.close()  # idempotent
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    coll = next(e for e in events if e["cat"] == "collective")
    assert coll["name"] == "allreduce.grads" and coll["pid"] == 3 and coll["args"]["bytes"] == 4096
    assert coll["ts"] == pytest.approx(1000.0) and coll["dur"] == pytest.approx(500.0)
    assert any(e["cat"] == "step" and e["dur"] == pytest.approx(2000.0) for e in events)
    assert sorted(os.listdir(tmp_path)) == ["trace3.json"]  # no temporary file left behind


def test_timeline_path_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMELINE_ENV, str(tmp_path / "t.json"))
    with Timeline(rank=0) as t0, Timeline(rank=2) as t2:
        t0.add("a", "collective", 0.0, 1.0, bytes=1)
        t2.add("b", "collective", 0.0, 1.0, bytes=2)
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.rank2.json"]
    with Timeline(str(tmp_path / "r{rank}.json"), rank=5) as t5:
        assert t5.path.endswith("r5.json")
    assert (tmp_path / "r5.json").exists()


def test_timeline_off_without_path_and_bounded(tmp_path):
    off = Timeline()
    off.add("a", "collective", 0.0, 1.0)
    off.close()
    assert not off.enabled and off.path is None
    capped = Timeline(tmp_path / "c.json", max_events=2)
    for i in range(5):
        capped.add(f"e{i}", "collective", float(i), 0.1)
    capped.close()
    doc = json.loads((tmp_path / "c.json").read_text())
    assert len([e for e in doc["traceEvents"] if e["ph"] == "X"]) == 2
    assert doc["otherData"]["dropped_events"] == 3


def test_scaling_efficiency():
    assert scaling_efficiency(100.0, 700.0, 8) == pytest.approx(0.875)
    assert scaling_efficiency(100.0, 100.0, 1) == 1.0
    with pytest.raises(ConfigError, match="n must be"):
        scaling_efficiency(1.0, 1.0, 0)
    with pytest.raises(ConfigError, match="samples_per_s_1 must be a positive"):
        scaling_efficiency(0.0, 1.0, 2)
