"""Training steps create no tensor on the default device behind the user's back (device_correct.py)."""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_steps_name_their_device(backend):
    result = run_mpi(2, "device_correct:steps_name_their_device", backend=backend, timeout=300)
    assert result.output.count("OK rank") == 2, result.output[-3000:]
