"""Every collective on real processes: mpi and torch backends, 2 and 4 ranks."""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

SCENARIOS = ["allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "point_to_point"]


@pytest.mark.parametrize("np_", [2, 4], ids=lambda n: f"np{n}")
@pytest.mark.parametrize("backend", ["mpi", "torch"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_collective(scenario: str, backend: str, np_: int) -> None:
    run_mpi(np_, f"collectives:{scenario}", backend=backend, timeout=240)
