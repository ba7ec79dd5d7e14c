"""Keras 3 ZeRO stages 1 and 2 on real processes (mpirun, mpi backend): 2 ranks, one 4-rank case."""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("tensorflow")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}


def test_keras_zero_matches_data_parallel_np2() -> None:
    """SGD-momentum and Adam, stages 1 and 2, plus several units, eager mode, broadcasts, refusals."""
    run_mpi(2, "keras_zero:equivalence", optimizers=["sgd", "adam"], stages=[1, 2], timeout=300, env=ENV)


def test_keras_zero_matches_data_parallel_np4() -> None:
    run_mpi(4, "keras_zero:equivalence", optimizers=["sgd", "adam"], stages=[1, 2], extras=False,
            timeout=400, env=ENV)
