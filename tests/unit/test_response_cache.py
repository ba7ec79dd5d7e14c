"""The coordinator's response cache and its bit agreement: repeated requests negotiate in O(log N) small messages."""

import math

import numpy as np
import pytest

from fake_group import run_group
from shardwise.adapters.horovod.bit_exchange import tree_min
from shardwise.adapters.horovod.coordinator import Coordinator
from shardwise.core.errors import CollectiveMismatchError
from shardwise.core.negotiation import RequestMeta, Response, ResponseCache

pytestmark = pytest.mark.timeout(60)


def _allreduce(coord: Coordinator, name: str, x: np.ndarray):
    meta = RequestMeta(name, "allreduce", (x.dtype.name,), (x.shape,), op="sum")
    return coord.submit(meta, lambda comm, resp: comm.allreduce(x.copy(), "sum"))


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 9])
def test_tree_min_is_the_and_of_every_rank_in_log_n_messages(size: int) -> None:
    def body(comm):
        vec = np.ones(6, dtype=np.uint8)
        vec[comm.rank % 6] = 0
        return tree_min(comm, vec)

    out = run_group(size, body)
    want = np.ones(6, dtype=np.uint8)
    want[[r % 6 for r in range(size)]] = 0
    for got, traffic in out:
        assert got.tolist() == want.tolist()
        assert traffic.messages <= math.ceil(math.log2(size)) + 1 if size > 1 else traffic.messages == 0
        assert traffic.bytes_sent == 6 * traffic.messages


def test_the_cache_gives_bits_alike_and_refuses_what_did_not_run_everywhere() -> None:
    metas = [RequestMeta("g", "allreduce", ("float32",), ((3,),), op="sum") for _ in range(2)]
    caches = [ResponseCache(rank) for rank in range(2)]
    ok = Response("allreduce", "g", tuple(metas))
    for cache in caches:
        assert cache.put(ok) == 0 and cache.put(ok) is None  # once per name
        assert cache.put(Response("allreduce", "bad", tuple(metas), error="Mismatched")) is None
        assert cache.put(Response("allreduce", "j", (metas[0], None), joined=(1,))) is None
        assert cache.lookup(metas[0]) == 0 and cache.response(0) is ok
        assert cache.lookup(RequestMeta("g", "allreduce", ("float32",), ((4,),), op="sum")) is None
        assert cache.bit_of("g") == 0 and cache.width == 1
        cache.evict(0)
        assert cache.bit_of("g") is None and cache.width == 1
        with pytest.raises(KeyError, match="bit 0 is empty"):
            cache.response(0)
        assert cache.put(ok) == 0  # the freed bit is taken again


def test_repeated_requests_agree_by_bits_without_a_full_round() -> None:
    def body(comm):
        coord = Coordinator(comm)
        first = [_allreduce(coord, f"g{i}", np.full(2, float(comm.rank))).wait(10).tolist() for i in range(3)]
        full = coord.stats.full_rounds
        again = []
        for step in range(4):  # submitted in a different order on each rank: matched by bits
            names = [f"g{i}" for i in (range(3) if comm.rank % 2 else reversed(range(3)))]
            futures = {n: _allreduce(coord, n, np.full(2, float(step + comm.rank))) for n in names}
            again.append({n: f.wait(10).tolist() for n, f in futures.items()})
        full_rounds, requests = coord.stats.full_rounds - full, coord.stats.requests
        coord.shutdown()
        return first, again, full_rounds, requests

    size = 4
    for first, again, full_rounds, requests in run_group(size, body):
        assert first == [[6.0, 6.0]] * 3
        assert again == [{f"g{i}": [4.0 * step + 6] * 2 for i in range(3)} for step in range(4)]
        assert full_rounds == 0 and requests == 15


def test_a_rank_that_changes_a_cached_request_fails_it_everywhere_and_the_rest_go_on() -> None:
    def body(comm):
        coord = Coordinator(comm)
        _allreduce(coord, "x", np.ones(3)).wait(10)
        with pytest.raises(CollectiveMismatchError, match="tensor shapes"):
            _allreduce(coord, "x", np.ones(4 if comm.rank == 1 else 3)).wait(10)
        changed = _allreduce(coord, "x", np.ones(5)).wait(10)  # every rank: negotiated again in full
        repeated = _allreduce(coord, "x", np.ones(5)).wait(10)
        coord.shutdown()
        return changed.tolist(), repeated.tolist()

    assert run_group(3, body) == [([3.0] * 5, [3.0] * 5)] * 3


def test_a_joined_rank_contributes_zeros_to_cached_requests() -> None:
    def body(comm):
        coord = Coordinator(comm)
        warm = _allreduce(coord, "x", np.full(3, 1.0)).wait(10).tolist()
        if comm.rank == 0:
            last, out = coord.join().wait(10), None
        else:
            out = _allreduce(coord, "x", np.full(3, 5.0)).wait(10).tolist()
            last = coord.join().wait(10)
        after = _allreduce(coord, "x", np.full(3, 1.0)).wait(10).tolist()  # the cache serves again
        coord.shutdown()
        return warm, out, last, after

    assert run_group(3, body) == [([3.0] * 3, None, 2, [3.0] * 3)] + [([3.0] * 3, [10.0] * 3, 2, [3.0] * 3)] * 2


def test_capacity_zero_turns_the_cache_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "0")

    def body(comm):
        coord = Coordinator(comm)
        out = [_allreduce(coord, "g", np.ones(2)).wait(10).tolist() for _ in range(3)]
        full, messages = coord.stats.full_rounds, coord.stats.messages
        coord.shutdown()
        return out, full, messages

    for out, full, messages in run_group(2, body):
        assert out == [[2.0, 2.0]] * 3 and full >= 3 and messages == full  # one allgather a round, no bits


def test_a_bad_capacity_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.backends.local.communicator import LocalCommunicator
    from shardwise.core.errors import ConfigError

    monkeypatch.setenv("SHARDWISE_CACHE_CAPACITY", "lots")
    with pytest.raises(ConfigError, match="SHARDWISE_CACHE_CAPACITY='lots' must be a number of requests >= 0"):
        Coordinator(LocalCommunicator())
    with pytest.raises(ValueError, match="capacity is a number of bits >= 0"):
        ResponseCache(0, capacity=-1)
