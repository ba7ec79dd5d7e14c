"""examples/ray_digits.py (2 Ray actors) and examples/spark_digits.py (2 Spark tasks) reach the
accuracy of the same example under mpirun (run once, shared by both)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import pytest
from example_results import example_result

pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")


def run_example(argv: list[str], name: str, tmp: str) -> dict[str, Any]:
    proc = subprocess.run(argv + ["--checkpoint-dir", os.path.join(tmp, name)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return example_result(proc.stdout, name)


@pytest.fixture(scope="module")
def mpi_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = run_example(["mpirun", "-np", "2", "--oversubscribe", sys.executable, "examples/torch_digits.py"],
                         "torch_digits", str(tmp_path_factory.mktemp("mpi")))
    assert result["ranks"] == 2, result
    return result


def check_same_training(got: dict[str, Any], mpi: dict[str, Any]) -> None:
    assert got["test_accuracy"] > 0.9
    assert abs(got["test_accuracy"] - mpi["test_accuracy"]) < 0.01 and abs(got["loss"] - mpi["loss"]) < 1e-3, \
        (got, mpi)


@pytest.mark.timeout(280)
def test_digits_on_ray_actors_matches_mpirun(mpi_reference: dict[str, Any]) -> None:
    pytest.importorskip("ray")
    with tempfile.TemporaryDirectory() as tmp:
        ray = run_example([sys.executable, "examples/ray_digits.py", "--np", "2"], "ray_digits", tmp)
    assert ray["actors"] == 2, ray
    check_same_training(ray, mpi_reference)


@pytest.mark.timeout(280)
def test_digits_on_spark_tasks_matches_mpirun(mpi_reference: dict[str, Any]) -> None:
    pytest.importorskip("pyspark", reason="needs pyspark: pip install 'shardwise[spark]'")
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        pytest.skip("needs a Java runtime for Spark: apt-get install openjdk-17-jre-headless, or set JAVA_HOME")
    with tempfile.TemporaryDirectory() as tmp:
        spark = run_example([sys.executable, "examples/spark_digits.py", "--np", "2"], "spark_digits", tmp)
    assert spark["tasks"] == 2, spark
    check_same_training(spark, mpi_reference)
