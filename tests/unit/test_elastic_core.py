"""The elastic building blocks without a job: the secret-protected store, generations, state, sampler."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from shardwise.core.errors import HostsUpdatedInterrupt, RendezvousError, WorkerLostError, is_peer_loss
from shardwise.backends.rendezvous.membership import Membership, change_wanted, endpoint_from_env, join
from shardwise.elastic.run import run_fn
from shardwise.elastic.state import ObjectState
from shardwise.backends.rendezvous.store import StoreClient, StoreServer, new_secret


@pytest.fixture
def server():
    srv = StoreServer(new_secret(), host="127.0.0.1")
    yield srv
    srv.close()


def client(srv: StoreServer, secret: str | None = None) -> StoreClient:
    return StoreClient("127.0.0.1", srv.port, secret or srv.secret, timeout=5, connect_timeout=5)


def test_store_operations(server):
    c = client(server)
    c.set("a", b"\x00\xffbinary")
    assert c.get("a") == b"\x00\xffbinary"
    assert c.add("n", 2) == 2 and c.add("n", 3) == 5
    assert c.check(["a", "n"]) and not c.check(["a", "missing"])
    assert c.compare_set("cas", b"", b"first") == b"first"
    assert c.compare_set("cas", b"wrong", b"second") == b"first"
    assert c.compare_set("cas", b"first", b"second") == b"second"
    assert c.delete("a") and not c.delete("a")
    with pytest.raises(TimeoutError):
        c.get("never", timeout=0.2)


def test_store_get_blocks_until_another_client_sets(server):
    writer = client(server)
    threading.Timer(0.2, lambda: writer.set("late", b"v")).start()
    started = time.monotonic()
    assert client(server).get("late", timeout=5) == b"v"
    assert time.monotonic() - started >= 0.15


def test_store_refuses_a_client_without_the_secret_and_keeps_serving(server):
    member = client(server)
    member.set("k", b"1")
    with pytest.raises(RendezvousError, match="refused"):
        client(server, new_secret())
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        assert len(raw.recv(32)) == 32
        raw.sendall(b"x" * 32)
        assert raw.recv(1) == b""  # closed: no reply to a bad proof
    assert server.refused == 2
    assert member.get("k") == b"1"  # the job's own clients are unaffected


def test_generations_place_waiting_workers_in_rank_order(server):
    membership = Membership(server)
    results = {}

    def worker(name: str) -> None:
        results[name] = join(client(server), name, -1, timeout=10)

    threads = [threading.Thread(target=worker, args=(w,)) for w in ("w0", "w1")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while len(membership.requests()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert membership.requests() == {"w0": -1, "w1": -1}
    membership.publish(["w0", "w1"])
    for t in threads:
        t.join(5)
    assert (results["w0"].rank, results["w1"].rank, results["w0"].size) == (0, 1, 2)
    assert membership.requests() == {}
    watcher = client(server)
    assert not change_wanted(watcher, 0)
    membership.announce()
    assert change_wanted(watcher, 0)


def test_join_times_out_when_the_driver_gives_no_place(server):
    with pytest.raises(RendezvousError, match="no place"):
        join(client(server), "w9", -1, timeout=0.5)


def test_endpoint_from_env():
    assert endpoint_from_env({}) is None
    env = {"SHARDWISE_RDZV_ADDR": "10.0.0.1:1234", "SHARDWISE_RDZV_SECRET": "ab", "SHARDWISE_WORKER_ID": "w3"}
    ep = endpoint_from_env(env)
    assert (ep.host, ep.port, ep.worker_id) == ("10.0.0.1", 1234, "w3")
    with pytest.raises(ValueError, match="host:port"):
        endpoint_from_env({**env, "SHARDWISE_RDZV_ADDR": "nohost"})
    with pytest.raises(ValueError, match="missing"):
        endpoint_from_env({"SHARDWISE_RDZV_ADDR": "h:1"})


def test_object_state_commit_restore_and_sync():
    state = ObjectState(bcast_object=lambda obj: {**obj, "epoch": 7}, get_rank=lambda: 0, epoch=0, items=[1])
    state.items.append(2)
    state.save()
    state.items.append(3)
    state.epoch = 5
    state.restore()
    assert state.items == [1, 2] and state.epoch == 0
    state.sync()
    assert state.epoch == 7


def test_run_fn_restores_after_a_lost_worker_and_keeps_state_after_a_host_update():
    events, attempts, resets = [], [], []

    class Recorder(ObjectState):
        def restore(self):
            events.append("restore")
            super().restore()

        def sync(self):
            events.append("sync")

    state = Recorder(bcast_object=lambda o: o, get_rank=lambda: 0, progress=0)
    state.register_reset_callbacks([lambda: events.append("callback")])

    def train(st):
        attempts.append(st.progress)
        st.progress += 10
        if len(attempts) == 1:
            raise WorkerLostError("peer gone")
        if len(attempts) == 2:
            raise HostsUpdatedInterrupt()
        return st.progress

    # the loss rolls progress back to the commit (0); the host update keeps it (10)
    assert run_fn(train, lambda lost: resets.append(lost))(state) == 20
    assert attempts == [0, 0, 10]
    assert resets == [True, False]
    assert events == ["sync", "restore", "callback", "sync", "callback", "sync"]


def test_run_fn_lets_other_errors_through():
    state = ObjectState(bcast_object=lambda o: o, get_rank=lambda: 0)

    def broken(_):
        raise ValueError("a bug, not a lost worker")

    with pytest.raises(ValueError):
        run_fn(broken, lambda lost: None)(state)


def test_peer_loss_detection():
    assert is_peer_loss(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
    assert is_peer_loss(WorkerLostError("x"))
    assert not is_peer_loss(RuntimeError("shape mismatch"))
