"""The harness's shared jobs: scenarios run in one job, each with its own output; failures and hangs end it."""

import re

import pytest

from mpi_harness import run_mpi

pytest.importorskip("mpi4py")

pytestmark = pytest.mark.mpi

ENV = {"SHARDWISE_TEST_JOB": "harness"}  # a job of its own, not shared with other tests


def _pids(output: str, tag: str) -> set[str]:
    return set(re.findall(rf"^tag={tag} rank=\d pid=(\d+)$", output, re.M))


def test_scenarios_share_the_processes_and_keep_their_own_output() -> None:
    first = run_mpi(2, "harness_scenarios:report", tag="a", env=ENV, shared=True, timeout=60)
    second = run_mpi(2, "harness_scenarios:report", tag="b", env=ENV, shared=True, timeout=60)
    assert len(_pids(first.output, "a")) == 2 and "tag=b" not in first.output, first.output
    assert _pids(second.output, "b") == _pids(first.output, "a"), (first.output, second.output)
    assert "SCENARIO END" not in first.output + second.output


def test_a_failure_names_the_rank_and_the_next_scenario_gets_fresh_processes() -> None:
    before = run_mpi(2, "harness_scenarios:report", tag="c", env=ENV, shared=True, timeout=60)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)rank\(s\) 1 failed.*failed on rank 1 on purpose"):
        run_mpi(2, "harness_scenarios:fail_on", rank=1, env=ENV, shared=True, timeout=60)
    after = run_mpi(2, "harness_scenarios:report", tag="d", env=ENV, shared=True, timeout=60)
    assert len(_pids(after.output, "d")) == 2 and not _pids(after.output, "d") & _pids(before.output, "c")


def test_a_hang_is_killed_at_the_timeout() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"hung: killed after 5 s"):
        run_mpi(2, "harness_scenarios:hang", env=ENV, shared=True, timeout=5)
    after = run_mpi(2, "harness_scenarios:report", tag="e", env=ENV, shared=True, timeout=60)
    assert len(_pids(after.output, "e")) == 2


def test_a_scenario_expected_to_fail_is_refused() -> None:
    with pytest.raises(ValueError, match="shared=False"):
        run_mpi(2, "harness_scenarios:report", tag="f", env=ENV, shared=True, expect_ok=False)
