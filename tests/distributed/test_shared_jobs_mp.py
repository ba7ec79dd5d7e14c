"""The harness's shared jobs: scenarios run in one job, each with its own output; failures and hangs end it."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "own job"])
def test_a_hang_is_killed_at_the_timeout_ranks_included(shared: bool) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"hung: killed after 5 s") as failure:
        run_mpi(2, "harness_scenarios:hang", env=ENV, shared=shared, timeout=5)
    ranks = [int(pid) for pid in _pids(str(failure.value), "hang")]
    assert len(ranks) == 2, str(failure.value)
    assert not _outliving(ranks, 10), "a hung rank outlived its killed job"
    after = run_mpi(2, "harness_scenarios:report", tag="e", env=ENV, shared=True, timeout=60)
    assert len(_pids(after.output, "e")) == 2


def test_a_scenario_expected_to_fail_is_refused() -> None:
    with pytest.raises(ValueError, match="shared=False"):
        run_mpi(2, "harness_scenarios:report", tag="f", env=ENV, shared=True, expect_ok=False)


#: A harness process that starts a shared job, prints its ranks' pids and waits to be killed.
_ORPHANING = """
import sys
sys.path[:0] = [{tests!r}, {here!r}]
import mpi_harness
result = mpi_harness.run_mpi(2, "harness_scenarios:report", tag="o", env={env!r}, shared=True, timeout=60)
print("commands=" + str(next(iter(mpi_harness.SHARED_JOBS.jobs.values())).commands))
print(result.output, flush=True)
import time
time.sleep(600)
"""


def test_the_ranks_leave_when_the_harness_is_killed() -> None:
    here = Path(__file__).resolve().parent
    code = _ORPHANING.format(tests=str(here.parent), here=str(here), env=ENV)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        while not _pids("".join(lines), "o") or len(_pids("".join(lines), "o")) < 2:
            line = proc.stdout.readline()
            assert line, "the harness ended before its job reported"
            lines.append(line)
        ranks = [int(pid) for pid in _pids("".join(lines), "o")]
        commands = Path(re.search(r"^commands=(.+)$", "".join(lines), re.M).group(1))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = _outliving(ranks, 20)
    assert not left, f"ranks {left} outlived their harness by 20 s"
    assert not commands.exists(), "the ranks left their job's command folder behind"


def _outliving(pids: list[int], seconds: float) -> list[int]:
    """Which of ``pids`` still run after ``seconds`` (SIGKILLed then, so that none is left behind)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"
