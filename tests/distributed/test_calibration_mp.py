"""Planner calibration on this machine: predicted vs measured per-rank memory of pipeline stages.

(The ZeRO calibration runs inside tests/distributed/zero_scenarios.py:equivalence.)
"""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [2, 4])
def test_planner_predicts_pipeline_stage_memory(np_):
    run_mpi(np_, "calibration:pipeline_memory", backend="mpi", timeout=120)
