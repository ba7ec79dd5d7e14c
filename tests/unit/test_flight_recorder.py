"""The flight recorder's ring, the recording wrapper and the stall watch, without processes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from shardwise.backends.local.communicator import LocalCommunicator
from shardwise.backends.recorded import RecordedCommunicator
from shardwise.backends.stall_watch import StallWatch, format_stacks
from shardwise.core.errors import ConfigError
from shardwise.core.flight_recorder import RING_SIZE, FlightRecorder, Progress, describe_stall, missing_ranks


def test_the_ring_keeps_the_last_32_in_order() -> None:
    rec = FlightRecorder("world")
    for i in range(40):
        rec.end(rec.start("allreduce", name=f"g{i}", dtype="float32", shape=(i,)))
    kept = rec.records()
    assert RING_SIZE == 32 and len(kept) == 32
    assert [r.seq for r in kept] == list(range(9, 41))
    assert kept[-1].name == "g39" and kept[-1].shape == (39,) and kept[-1].state == "completed"
    assert rec.last_started == rec.last_completed == 40 and rec.oldest_pending() is None
    text = rec.format()
    assert text.startswith("group world: last 32 of 40 collectives (last completed #40)")
    assert "name='g39'" in text and "name='g8'" in text and "name='g7'" not in text


def test_pending_failed_and_out_of_order_completion() -> None:
    rec = FlightRecorder("world/split1", capacity=4)
    a, b, c = rec.start("allreduce"), rec.start("allgather"), rec.start("barrier")
    rec.end(b)
    assert rec.oldest_pending() is a and rec.last_completed == 2
    rec.end(a, ok=False)
    rec.end(a)  # idempotent: stays failed
    assert a.state == "failed" and rec.oldest_pending() is c
    assert "started" in rec.format() and "waiting" in rec.format()
    assert rec.progress(rank=7, group_rank=1) == Progress(7, 1, 3, 2)


@pytest.mark.parametrize("kwargs, match", [({"group": "w", "capacity": 0}, "at least one entry"),
                                           ({"group": ""}, "group label")])
def test_bad_recorders_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FlightRecorder(**kwargs)


def test_missing_ranks_and_the_verdict() -> None:
    rec = FlightRecorder("world")
    for _ in range(3):
        record = rec.start("allreduce", name="x")
    answers = [Progress(0, 0, 3, 2), Progress(1, 1, 2, 2), Progress(2, 2, 3, 2), Progress(3, 3, 1, 1)]
    assert missing_ranks(3, answers) == [1, 3]
    with pytest.raises(ValueError, match="start at 1"):
        missing_ranks(0, answers)
    text = describe_stall(record, 5.0, answers, silent=[4], waited=6.2)
    assert text.startswith("allreduce #3 'x' on world stalled: not finished after 6.2 s (stall timeout 5 s)")
    assert "missing ranks [1, 3] have not reached it" in text and "ranks [4] did not answer" in text


def test_the_wrapper_records_blocking_async_and_sub_communicators() -> None:
    watch = StallWatch(10.0, 0, 1)
    comm = RecordedCommunicator(LocalCommunicator(), watch)
    comm.allreduce(np.ones(3, dtype=np.float32), name="a")
    handle = comm.allgather_async(np.ones((2, 2)), name="b")
    assert comm.recorder.oldest_pending().op == "allgather"
    handle.wait()
    comm.barrier()
    sub = comm.split(color=0)
    sub.broadcast(np.zeros(1), 0)
    assert [(r.op, r.state) for r in comm.recorder.records()] == [
        ("allreduce", "completed"), ("allgather", "completed"), ("barrier", "completed"), ("split", "completed")]
    assert comm.recorder.records()[0].dtype == "float32" and comm.recorder.records()[0].shape == (3,)
    assert sub.recorder.group == "world/split.c0.1" and sub.recorder.last_completed == 1
    assert [r.group for r in watch.recorders()] == ["world", "world/split.c0.1"]
    sub.free()
    assert [r.group for r in watch.recorders()] == ["world"]


class _Pipe:
    """Two in-process side channels: what one posts, the other polls."""

    def __init__(self) -> None:
        self.boxes: dict[int, list] = {0: [], 1: []}

    def end(self, me: int) -> "_PipeEnd":
        return _PipeEnd(self, me)


class _PipeEnd:
    def __init__(self, pipe: _Pipe, me: int) -> None:
        self.pipe, self.me = pipe, me

    def post(self, dest: int, message: object) -> None:
        self.pipe.boxes[dest].append((self.me, message))

    def poll(self) -> list:
        got, self.pipe.boxes[self.me] = self.pipe.boxes[self.me], []
        return got


def test_a_stall_dumps_both_ranks_and_names_the_missing_one() -> None:
    pipe, said = _Pipe(), {0: [], 1: []}
    watches = [StallWatch(2.0, r, 2, pipe.end(r), out=said[r].append) for r in range(2)]
    rings = [FlightRecorder("world"), FlightRecorder("world")]
    for rank, (watch, ring) in enumerate(zip(watches, rings)):
        watch.register(ring, rank)
        ring.end(ring.start("barrier"))
    stalled = rings[0].start("allreduce", name="grads", dtype="float32", shape=(4,))  # rank 1 never comes
    now = stalled.started + 1.0
    watches[0].poll(now)
    assert said[0] == []  # not yet stalled
    watches[0].poll(now + 1.5)  # 2.5 s: rank 0 dumps and asks rank 1
    assert "stall dump" in said[0][0] and "allreduce #2 'grads' on world has waited" in said[0][0]
    assert "#2      allreduce         float32[4] started" in said[0][0]
    watches[1].poll(now + 1.6)  # rank 1 dumps (its stacks: this test) and answers
    assert "rank 0 reports world collective #2 stalled" in said[1][0]
    assert "test_a_stall_dumps_both_ranks_and_names_the_missing_one" in said[1][0]
    watches[0].poll(now + 1.7)
    verdict = said[0][-1]
    assert verdict.startswith("[shardwise flight rank 0/2] allreduce #2 'grads' on world stalled")
    assert "missing ranks [1] have not reached it" in verdict
    watches[0].poll(now + 5)
    assert len(said[0]) == 2  # one dump and one verdict per stall


def test_without_a_side_channel_a_stalled_rank_still_dumps() -> None:
    said: list[str] = []
    watch = StallWatch(1.0, 3, 4, None, out=said.append)
    ring = FlightRecorder("world")
    watch.register(ring, 3)
    record = ring.start("broadcast")
    watch.poll(record.started + 1.5)
    assert "stall dump" in said[0] and "cannot be named without an MPI side channel" in said[1]


def test_the_watch_thread_starts_and_stops() -> None:
    said: list[str] = []
    watch = StallWatch(0.2, 0, 1, None, interval=0.02, out=said.append)
    ring = FlightRecorder("world")
    watch.register(ring, 0)
    ring.start("allreduce")
    watch.start()
    deadline = time.monotonic() + 5
    while not said and time.monotonic() < deadline:
        time.sleep(0.02)
    watch.close()
    assert said and "stall dump" in said[0]
    assert not any(t.name == "shardwise-stall-watch" and t.is_alive() for t in threading.enumerate()
                   if t is watch._thread)


@pytest.mark.parametrize("kwargs, match", [({"timeout": 0, "rank": 0, "size": 1}, "positive seconds"),
                                           ({"timeout": "5", "rank": 0, "size": 1}, "positive seconds"),
                                           ({"timeout": 1, "rank": 2, "size": 2}, "outside a job of size 2")])
def test_bad_watches_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        StallWatch(**kwargs)


def test_bad_stall_timeouts_are_refused_at_init(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise

    with pytest.raises(ConfigError, match="stall_timeout must be positive seconds, got -1"):
        shardwise.init("local", stall_timeout=-1)
    monkeypatch.setenv("SHARDWISE_STALL_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="SHARDWISE_STALL_TIMEOUT='soon' is not a number of seconds"):
        shardwise.init("local")
    assert not shardwise.is_initialized()


def test_format_stacks_names_every_thread() -> None:
    text = format_stacks()
    assert "thread MainThread" in text and "test_format_stacks_names_every_thread" in text
