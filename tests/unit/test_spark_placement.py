"""How shardwise.spark numbers ranks and checks sizes, without a Spark session."""

from __future__ import annotations

import pytest

from shardwise.core.errors import ConfigError, JobFailedError
from shardwise.elastic.driver import check_sizes
from shardwise.spark._task import FAILURE_CLOSE, FAILURE_OPEN, RankFailed, rank_order
from shardwise.spark.runner import _failure


def test_ranks_are_numbered_host_by_host_in_order_of_first_task() -> None:
    assert rank_order(["a", "a"]) == [0, 1]
    # tasks 0 and 2 on host a, 1 and 3 on host b: a's ranks first, so local ranks are contiguous
    assert rank_order(["a", "b", "a", "b"]) == [0, 2, 1, 3]
    assert rank_order(["b", "a", "a", "c", "b"]) == [0, 2, 3, 4, 1]


def test_a_rank_failure_travels_inside_sparks_message() -> None:
    exc = RankFailed(3, "Traceback (most recent call last):\n  ...\nKeyError: 'x'\n")
    wrapped = RuntimeError(f"Job aborted due to stage failure: Py4JJavaError ... {exc} ... at org.apache")
    failure = _failure(wrapped)
    assert isinstance(failure, JobFailedError) and failure.rank == 3
    assert "KeyError: 'x'" in str(failure) and FAILURE_OPEN not in str(failure) and FAILURE_CLOSE not in str(failure)
    assert _failure(RuntimeError("some other Spark error")) is None


def test_elastic_sizes_are_checked() -> None:
    assert check_sizes(2, None, None, elastic=True) == (1, 2)
    assert check_sizes(2, None, None, elastic=False) == (2, 2)
    assert check_sizes(2, 1, 4, elastic=True) == (1, 4)
    with pytest.raises(ConfigError, match="min workers"):
        check_sizes(2, 3, 4, elastic=True)
    with pytest.raises(ConfigError, match=">= 1"):
        check_sizes(0, None, None, elastic=True)


def test_run_refuses_an_unknown_backend_before_looking_for_spark() -> None:
    import shardwise.spark

    with pytest.raises(ConfigError, match="unknown backend 'nccl2'"):
        shardwise.spark.run(print, backend="nccl2")


def test_mpirun_is_started_again_only_when_pmix_gave_up_before_any_rank(tmp_path) -> None:
    import sys

    from shardwise.backends.rendezvous import StoreServer, new_secret
    from shardwise.backends.rendezvous.store import StoreClient
    from shardwise.spark import _mpi

    secret = new_secret()
    server = StoreServer(secret, host="127.0.0.1")
    store = StoreClient("127.0.0.1", server.port, secret)
    try:
        gave_up = tmp_path / "err"
        gave_up.write_text("-----\nThe PMIx server's listener thread failed to start. We cannot\ncontinue.\n")
        state = _mpi._TaskState(store, 0, None, mpirun_err=str(gave_up), launches=1)
        assert _mpi._launcher_gave_up(state)
        state.launches = _mpi._LAUNCH_TRIES
        assert not _mpi._launcher_gave_up(state)  # tries used up
        state.launches = 1
        store.add(_mpi.STARTED_KEY, 1)
        assert not _mpi._launcher_gave_up(state)  # a rank started: its failure is the job's
        other = tmp_path / "other"
        other.write_text("mpirun was unable to find the specified executable\n")
        fresh = _mpi._TaskState(store, 0, None, mpirun_err=str(other), launches=1)
        store.delete(_mpi.STARTED_KEY)
        assert not _mpi._launcher_gave_up(fresh)  # another failure is not retried

        state = _mpi._TaskState(store, 0, None, command=[sys.executable, "-c", "pass"], env={}, launches=0)
        _mpi._start_mpirun(state)
        assert state.launches == 1 and state.mpirun.wait(timeout=30) == 0
        _mpi._echo_and_remove(state.mpirun_err)
    finally:
        store.close()
        server.close()
