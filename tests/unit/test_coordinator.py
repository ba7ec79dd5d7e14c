"""The coordinator thread on an in-process group: matching by name, errors in step, join, shutdown."""

import numpy as np
import pytest

from fake_group import run_group
from shardwise.adapters.horovod.coordinator import Coordinator, CoordinatorShutdownError, DuplicateNameError
from shardwise.core.errors import CollectiveMismatchError
from shardwise.core.negotiation import RequestMeta

pytestmark = pytest.mark.timeout(60)


def _allreduce(coord: Coordinator, name: str, x: np.ndarray):
    meta = RequestMeta(name, "allreduce", (x.dtype.name,), (x.shape,), op="sum")
    return coord.submit(meta, lambda comm, resp: comm.allreduce(x.copy(), "sum"))


def test_requests_submitted_in_different_orders_complete_by_name() -> None:
    def body(comm):
        coord = Coordinator(comm)
        names = ["a", "b", "c"] if comm.rank == 0 else ["c", "a", "b"]
        futures = {n: _allreduce(coord, n, np.full(2, ord(n) * (comm.rank + 1), dtype=np.float64))
                   for n in names}
        out = {n: f.wait(10).tolist() for n, f in futures.items()}
        coord.shutdown()
        return out

    for out in run_group(2, body):
        assert out == {n: [ord(n) * 3.0] * 2 for n in "abc"}


def test_mismatch_raises_on_every_rank_and_the_next_request_runs() -> None:
    def body(comm):
        coord = Coordinator(comm)
        with pytest.raises(CollectiveMismatchError, match="tensor shapes"):
            _allreduce(coord, "x", np.ones(3 + comm.rank)).wait(10)
        got = _allreduce(coord, "y", np.ones(2)).wait(10)
        coord.shutdown()
        return got.tolist()

    assert run_group(2, body) == [[2.0, 2.0]] * 2


def test_a_name_stays_in_flight_until_its_result_is_collected() -> None:
    def body(comm):
        coord = Coordinator(comm)
        first = _allreduce(coord, "dup", np.ones(1))
        with pytest.raises(DuplicateNameError):
            _allreduce(coord, "dup", np.ones(1))
        first.wait(10)
        again = _allreduce(coord, "dup", np.ones(1)).wait(10)
        coord.shutdown()
        return again.tolist()

    assert run_group(2, body) == [[2.0]] * 2


def test_joined_rank_contributes_zeros_and_learns_the_last_joined_rank() -> None:
    def body(comm):
        coord = Coordinator(comm)
        if comm.rank == 0:
            last = coord.join().wait(10)
            out = None
        else:
            out = _allreduce(coord, "x", np.full(3, 5.0)).wait(10).tolist()
            last = coord.join().wait(10)
        coord.shutdown()
        return out, last

    assert run_group(3, body) == [(None, 2), ([10.0] * 3, 2), ([10.0] * 3, 2)]


def test_shutdown_fails_what_others_never_submitted_and_refuses_new_requests() -> None:
    def body(comm):
        coord = Coordinator(comm)
        pending = _allreduce(coord, "only-rank-0", np.ones(1)) if comm.rank == 0 else None
        coord.shutdown()
        if pending is not None:
            with pytest.raises(CoordinatorShutdownError):
                pending.wait(10)
        with pytest.raises(CoordinatorShutdownError):
            _allreduce(coord, "late", np.ones(1))
        return coord.alive()

    assert run_group(2, body) == [False, False]
