"""Adasum on real processes: mpi and torch backends, 2 and 4 ranks (see adasum_scenarios.py)."""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 4], ids=lambda n: f"np{n}")
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_adasum(backend: str, np_: int) -> None:
    run_mpi(np_, "adasum_scenarios:allreduce", backend=backend, timeout=120, shared=True)
