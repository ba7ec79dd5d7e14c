"""Horovod semantics of shardwise.torch under real mpirun: errors in step, join, grouped ops, timeline.

The scenarios are in hvd_parity.py; they mirror what Horovod's own test suite checks
(run it with ../shared/peer-suites/run-horovod-suite.sh test_torch.py shardwise).
"""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

SCENARIOS = ["errors_keep_ranks_in_step", "join_and_scaling", "grouped_sparse_timeline"]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_hvd_parity_2_ranks(backend: str, scenario: str) -> None:
    run_mpi(2, f"hvd_parity:{scenario}", timeout=120, env={"SHARDWISE_BACKEND": backend}, shared=True)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_hvd_parity_4_ranks(scenario: str) -> None:
    run_mpi(4, f"hvd_parity:{scenario}", timeout=180, env={"SHARDWISE_BACKEND": "mpi"}, shared=True)
