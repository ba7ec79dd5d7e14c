"""Horovod's Keras names on shardwise.keras under mpirun (2 ranks); scenarios in keras_hvd.py."""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


def test_keras_horovod_api_np2() -> None:
    run_mpi(2, "keras_hvd:keras_api", timeout=180, env={"SHARDWISE_BACKEND": "mpi", "OMP_NUM_THREADS": "1"})
