"""examples/ray_digits.py on 2 Ray actors reaches the accuracy of the same example under mpirun."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
from example_results import example_result

pytest.importorskip("ray")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(280)
def test_digits_on_ray_actors_matches_mpirun() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    with tempfile.TemporaryDirectory() as tmp:
        ray_run = subprocess.run([sys.executable, "examples/ray_digits.py", "--np", "2", "--checkpoint-dir",
                                  os.path.join(tmp, "ray")], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=200)
        assert ray_run.returncode == 0, ray_run.stderr[-3000:]
        mpi_run = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", sys.executable,
                                  "examples/torch_digits.py", "--checkpoint-dir", os.path.join(tmp, "mpi")],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
        assert mpi_run.returncode == 0, mpi_run.stderr[-3000:]
    ray = example_result(ray_run.stdout, "ray_digits")
    mpi = example_result(mpi_run.stdout, "torch_digits")
    assert ray["actors"] == 2 and mpi["ranks"] == 2, (ray, mpi)
    ray_loss, ray_accuracy, mpi_loss, mpi_accuracy = ray["loss"], ray["test_accuracy"], mpi["loss"], mpi["test_accuracy"]
    assert ray_accuracy > 0.9
    assert abs(ray_accuracy - mpi_accuracy) < 0.01 and abs(ray_loss - mpi_loss) < 1e-3, \
        (ray_loss, ray_accuracy, mpi_loss, mpi_accuracy)
