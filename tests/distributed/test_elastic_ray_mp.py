"""Elastic training on Ray actors: a worker SIGKILLed mid-epoch, the job goes on and grows back.

Each case runs ``elastic_ray.py`` (a Ray driver with 3 actors on this machine) and
checks its verdict: generations 3 -> 2 -> 3, every epoch saw each sample once, the
final parameters equal a one-process replay of the committed steps, all ranks agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))


def run_driver(config: dict, timeout: float = 200) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "elastic_ray.py"), json.dumps(config)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def check_elastic(verdict: dict, tolerance: float) -> None:
    assert [size for _, size in verdict["history"]] == [3, 2, 3]
    assert verdict["size_changes"] == [3, 2, 3], "no step ran on each world size in turn"
    assert verdict["final_size"] == 3 and verdict["ranks_agree"]
    assert verdict["max_diff"] < tolerance, verdict["max_diff"]
    assert verdict["recovery_seconds"] is not None and verdict["recovery_seconds"] < 30


@pytest.mark.timeout(240)
def test_ray_elastic_data_parallel_survives_a_killed_worker_and_a_foreign_client() -> None:
    verdict = run_driver({"kill_rank": 2, "final_size": 3, "intruder": True})
    check_elastic(verdict, 1e-9)
    intrusion = verdict["intrusion"]
    assert intrusion["wrong_secret"].startswith("refused"), intrusion
    assert intrusion["garbage_reply"] == "" and intrusion["refused_count"] >= 2, intrusion


@pytest.mark.timeout(240)
def test_ray_elastic_zero2_reshards_its_state() -> None:
    verdict = run_driver({"kill_rank": 1, "final_size": 3, "zero": 2})
    check_elastic(verdict, 1e-5)  # ZeRO keeps fp32 masters of the float64 model
