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
