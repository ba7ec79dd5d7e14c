"""Keras 3 / TF2 data parallelism on real processes (mpirun, mpi backend): 2 ranks, one 4-rank case."""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("tensorflow")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}


def test_fit_matches_single_process_np2() -> None:
    run_mpi(2, "keras_dp:fit_equivalence", optimizers=["sgd", "adam"], timeout=240, env=ENV)


def test_fit_matches_single_process_np4() -> None:
    run_mpi(4, "keras_dp:fit_equivalence", optimizers=["sgd", "adam"], extras=False, timeout=300, env=ENV)


def test_callbacks_np2(tmp_path) -> None:
    run_mpi(2, "keras_dp:callbacks", tmpdir=str(tmp_path), timeout=240, env=ENV)


def test_strategy_tensorflow_api_and_tape_np2() -> None:
    """MultiWorkerMirroredStrategy from MPI ranks, then the TF2 API and DistributedGradientTape."""
    run_mpi(2, "keras_dp:tensorflow_api", with_strategy=True, timeout=240, env=ENV)
