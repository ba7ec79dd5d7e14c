"""shardwise.spark.run / run_elastic on a local Spark session (``local[2]``), against numpy and one process.

``spark_jobs.py`` runs every scenario in one Spark session (one JVM start) and prints
a verdict per scenario. It runs with ``python3`` on PATH not being the driver's
Python and no PYSPARK_PYTHON: the jobs work only because shardwise hands Spark's
workers the driver's interpreter.
"""

from __future__ import annotations

import os
import sys

import pytest
from spark_support import check_rank_failure, driver_verdicts, require_spark

require_spark()
pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def verdicts() -> dict:
    venv_bin = os.path.realpath(os.path.dirname(sys.executable))
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != venv_bin]
    env = {k: v for k, v in os.environ.items() if k != "PYSPARK_PYTHON"}
    env["PATH"] = os.pathsep.join(path)
    return driver_verdicts(os.path.join(HERE, "spark_jobs.py"), env=env)


@pytest.mark.timeout(300)
def test_workers_run_the_drivers_python(verdicts: dict) -> None:
    assert verdicts["setup"]["worker_python_on_path"] != verdicts["setup"]["driver"]


@pytest.mark.timeout(300)
def test_results_come_back_in_rank_order_with_local_ranks(verdicts: dict) -> None:
    results = verdicts["order"]["results"]
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["size"] for r in results] == [2, 2]
    assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 2), (1, 2)]
    assert results[0]["pid"] != results[1]["pid"]


@pytest.mark.timeout(300)
def test_collectives_equal_numpy(verdicts: dict) -> None:
    assert verdicts["collectives"]["max_abs_diff"] < 1e-12, verdicts["collectives"]


@pytest.mark.timeout(300)
def test_a_failing_rank_fails_the_job_with_its_traceback(verdicts: dict) -> None:
    check_rank_failure(verdicts["failure"], 1, "ValueError: deliberate failure on rank 1")
    assert "in fail_on" in verdicts["failure"]["message"]
    assert verdicts["after_failure"] == {"ranks": [0, 1], "pids_differ": True}


@pytest.mark.timeout(300)
def test_more_processes_than_slots_fail_at_once(verdicts: dict) -> None:
    too_many = verdicts["too_many"]
    assert too_many["raised"] == "ConfigError" and too_many["seconds"] < 1.0, too_many
    assert "asked for 3 processes" in too_many["message"] and "at most 2 tasks" in too_many["message"]


@pytest.mark.timeout(300)
def test_elastic_job_loses_a_task_mid_epoch_and_finishes_on_the_survivors(verdicts: dict) -> None:
    elastic = verdicts["elastic"]
    assert elastic["killed"] and elastic["sizes"] == [2, 1, 2], elastic
    assert elastic["final_size"] == 2 and elastic["ranks_agree"], elastic
    assert elastic["max_diff"] < 1e-9, elastic


@pytest.mark.timeout(300)
def test_torch_distributor_runs_a_shardwise_function(verdicts: dict) -> None:
    assert verdicts["torch_distributor"]["result"] == {"rank": 0, "size": 2, "sum": 30.0, "backend": "torch"}
