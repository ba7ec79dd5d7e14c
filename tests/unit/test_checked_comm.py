"""CheckedCommunicator logic on an in-process thread group (no MPI)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fake_group import FakeComm, run_group
from shardwise.backends._call_desc import CallDesc, describe_mismatch, describe_tensor
from shardwise.backends.checked import CheckedCommunicator
from shardwise.backends.local import LocalCommunicator
from shardwise.core.errors import CollectiveMismatchError, CollectiveTimeoutError, ConfigError


def _errors(results: list) -> list[str]:
    assert all(isinstance(r, BaseException) for r in results), results
    return [str(r) for r in results]


def test_shape_mismatch_named_on_every_rank() -> None:
    def body(comm: FakeComm) -> None:
        checked = CheckedCommunicator(comm)
        checked.allreduce(np.zeros([17 if comm.rank == 1 else 16] * 3, np.float32), name="grad_bucket_3")

    results = run_group(4, body)
    assert all(isinstance(r, CollectiveMismatchError) for r in results)
    assert set(_errors(results)) == {"allreduce #1 'grad_bucket_3': rank 1 has shape (17, 17, 17) float32, "
                                     "ranks 0, 2, 3 have (16, 16, 16) float32"}


def test_mismatch_leaves_the_communicator_usable() -> None:
    def body(comm: FakeComm) -> object:
        checked = CheckedCommunicator(comm)
        with pytest.raises(CollectiveMismatchError):
            checked.allreduce(np.ones(2 + comm.rank))
        return checked.allreduce(np.ones(3), name="after").tolist()

    assert run_group(2, body) == [[2.0, 2.0, 2.0]] * 2


def test_skipped_collective_names_the_rank_and_both_calls() -> None:
    def body(comm: FakeComm) -> None:
        checked = CheckedCommunicator(comm)
        if comm.rank != 1:
            checked.allreduce(np.ones(4), name="a")
        checked.allreduce(np.ones(4), name="b")

    msgs = _errors(run_group(3, body))
    assert msgs[0] == msgs[1] == msgs[2]
    assert msgs[0].startswith("collective #1: rank 1 called allreduce 'b' ((4,) float64), "
                              "ranks 0, 2 called allreduce 'a' ((4,) float64)")


@pytest.mark.parametrize("case, expected", [
    ("op", "allreduce #1: rank 1 has reduce op max, rank 0 has reduce op sum"),
    ("dtype", "allreduce #1: rank 1 has shape (4,) float32, rank 0 has (4,) float64"),
    ("root", "broadcast #1: rank 1 has root 1, rank 0 has root 0"),
    ("kind", "collective #1: rank 1 called barrier, rank 0 called allgather ((2, 3) float64); every rank must "
             "make the same collectives in the same order (a rank skipped one or called an extra one)"),
    ("gather", "allgather #1: rank 1 has shape (2, 4) float64, rank 0 has (2, 3) float64 "
               "(allgather: only the first dimension may differ)"),
])
def test_what_differed(case: str, expected: str) -> None:
    def body(comm: FakeComm) -> None:
        c, one = CheckedCommunicator(comm), comm.rank == 1
        if case == "op":
            c.allreduce(np.ones(4), "max" if one else "sum")
        elif case == "dtype":
            c.allreduce(np.ones(4, np.float32 if one else np.float64))
        elif case == "root":
            c.broadcast(np.ones(4), root=comm.rank)
        elif case == "kind":
            c.barrier() if one else c.allgather(np.ones((2, 3)))
        else:
            c.allgather(np.ones((2, 4 if one else 3)))

    assert set(_errors(run_group(2, body))) == {expected}


def test_allgather_first_dims_may_differ() -> None:
    def body(comm: FakeComm) -> object:
        return CheckedCommunicator(comm).allgather(np.full((comm.rank + 1, 2), comm.rank)).shape

    assert run_group(3, body) == [(6, 2)] * 3


def test_uniform_allgather_checks_the_whole_shape() -> None:
    def body(comm: FakeComm) -> object:
        checked = CheckedCommunicator(comm)
        same = checked.allgather_async(np.full((2, 2), comm.rank), uniform=True).wait().shape
        checked.allgather(np.full((comm.rank + 1, 2), comm.rank), uniform=True)
        return same

    results = run_group(3, body)
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results
    assert set(_errors(results)) == {"allgather #2: rank 1 has shape (2, 2) int64, rank 2 has (3, 2) int64, "
                                     "rank 0 has (1, 2) int64"}


def test_timeout_names_missing_rank_on_all_waiting_ranks() -> None:
    def body(comm: FakeComm) -> None:
        checked = CheckedCommunicator(comm, timeout=0.3)
        if comm.rank != 2:
            checked.allreduce(np.ones(2), name="x")

    start = time.monotonic()
    results = run_group(3, body)
    assert time.monotonic() - start < 3
    assert results[2] is None
    for r in results[:2]:
        assert isinstance(r, CollectiveTimeoutError)
        assert str(r) == "allreduce #1 'x' timed out after 0.3 s: ranks [2] never arrived"


def test_timeout_names_missing_coordinator() -> None:
    def body(comm: FakeComm) -> None:
        if comm.rank != 0:
            CheckedCommunicator(comm, timeout=0.2).barrier()

    results = run_group(2, body)
    assert isinstance(results[1], CollectiveTimeoutError)
    assert str(results[1]).startswith("barrier #1 timed out after 0.4 s: ranks [0] never arrived")


def test_timed_handshake_still_detects_mismatch() -> None:
    def body(comm: FakeComm) -> None:
        CheckedCommunicator(comm, timeout=5).allreduce(np.ones(3 + comm.rank), name="g")

    assert set(_errors(run_group(2, body))) == {"allreduce #1 'g': rank 1 has shape (4,) float64, "
                                                "rank 0 has (3,) float64"}


def test_every_n_reports_first_divergent_call_late() -> None:
    def body(comm: FakeComm) -> None:
        checked = CheckedCommunicator(comm, every=3)
        checked.allreduce(np.ones(2), name="w" if comm.rank else "v")  # unchecked: runs anyway
        checked.allreduce(np.ones(2), name="y")
        checked.allreduce(np.ones(2), name="z")  # the check

    msg = set(_errors(run_group(2, body)))
    assert msg == {"collective #1: rank 1 called allreduce 'w' ((2,) float64), rank 0 called allreduce 'v' "
                   "((2,) float64); every rank must make the same collectives in the same order (a rank skipped "
                   "one or called an extra one) (found at the check of collective #3; with every=3 the calls in "
                   "between ran unchecked, so their results may be wrong)"}


def test_surplus_collective_caught_at_free() -> None:
    def body(comm: FakeComm) -> None:
        checked = CheckedCommunicator(comm)
        for _ in range(3 if comm.rank == 0 else 2):
            checked.allreduce(np.ones(4), name="x")
        checked.free()

    msgs = _errors(run_group(2, body))
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("collective #3: rank 1 called free, rank 0 called allreduce 'x' ((4,) float64)")


def test_async_split_and_objects_are_checked() -> None:
    def body(comm: FakeComm) -> object:
        checked = CheckedCommunicator(comm)
        sub = checked.split(color=0)
        assert isinstance(sub, CheckedCommunicator)
        got = checked.allreduce_async(np.ones(2), name="a").wait()
        objs = checked.allgather_object(comm.rank)
        return got.tolist(), objs, checked.broadcast_object("x", root=1)

    assert run_group(2, body) == [([2.0, 2.0], [0, 1], "x")] * 2


def test_size_one_delegates_and_exposes_extras() -> None:
    local = LocalCommunicator()
    checked = CheckedCommunicator(local, timeout=1)
    assert checked.allreduce(np.arange(3)).tolist() == [0, 1, 2]
    assert checked.backend == "local" and checked.inner is local and checked._mailbox is local._mailbox
    checked.barrier()
    checked.free()
    with pytest.raises(ConfigError):
        CheckedCommunicator(local, every=0)


def test_describe_tensor_is_framework_neutral() -> None:
    torch = pytest.importorskip("torch")
    assert describe_tensor(torch.zeros(2, 3, dtype=torch.bfloat16)) == ("bfloat16", (2, 3))
    assert describe_tensor(np.zeros((4,), np.int32)) == ("int32", (4,))
    assert describe_tensor(np.float64(1.0)) == ("float64", ())


def test_describe_mismatch_prefers_the_majority_as_reference() -> None:
    descs = [CallDesc(5, "allreduce", "g", "sum", "float32", (2,)) for _ in range(4)]
    descs[3] = CallDesc(5, "allreduce", "g", "sum", "float32", (3,))
    assert describe_mismatch(descs) == "allreduce #5 'g': rank 3 has shape (3,) float32, ranks 0, 1, 2 have (2,) float32"


def test_context_check_and_timeout_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.context import _env_timeout, _want_check

    monkeypatch.delenv("SHARDWISE_CHECK", raising=False)
    monkeypatch.delenv("SHARDWISE_CHECK_EVERY", raising=False)
    assert _want_check(None, None) == (False, 1)
    assert _want_check(None, 5.0) == (True, 1)
    assert _want_check(False, 5.0) == (False, 1)
    monkeypatch.setenv("SHARDWISE_CHECK", "1")
    monkeypatch.setenv("SHARDWISE_CHECK_EVERY", "4")
    assert _want_check(None, None) == (True, 4)
    monkeypatch.setenv("SHARDWISE_CHECK", "maybe")
    with pytest.raises(ConfigError, match="SHARDWISE_CHECK='maybe'"):
        _want_check(None, None)
    monkeypatch.setenv("SHARDWISE_TIMEOUT", "2.5")
    assert _env_timeout() == 2.5
    monkeypatch.setenv("SHARDWISE_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="not a number of seconds"):
        _env_timeout()


def test_store_handshake_names_missing_ranks_and_cleans_up() -> None:
    from fake_group import FakeStore
    from shardwise.backends._arrival import store_arrive

    store = FakeStore()

    def body(comm: FakeComm) -> object:
        for seq in (1, 2):
            vec = CallDesc(seq, "barrier").encode()
            table = store_arrive(store, "p", comm.rank, 3, vec, 5, f"barrier #{seq}", seq - 1 or None)
            assert (table == vec).all()
        if comm.rank == 2:
            return None
        return store_arrive(store, "p", comm.rank, 3, CallDesc(3, "barrier").encode(), 0.2, "barrier #3", 2)

    results = run_group(3, body)
    assert [str(r) for r in results[:2]] == ["barrier #3 timed out after 0.2 s: ranks [2] never arrived"] * 2
    assert not any(key.startswith("p/1/") for key in store.data)
