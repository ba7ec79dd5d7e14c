"""Keras 3 ZeRO stages 1 and 2 on real processes, on the TensorFlow, torch and JAX backends (mpirun)."""

import pytest

from keras_matrix import env_for, keras_backends
from mpi_harness import run_mpi

pytest.importorskip("keras")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_keras_zero_matches_data_parallel_np2(keras_backend: str) -> None:
    """SGD-momentum and Adam, stages 1 and 2, plus several units, eager mode, broadcasts, refusals."""
    run_mpi(2, "keras_zero:equivalence", optimizers=["sgd", "adam"], stages=[1, 2], timeout=300,
            env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_keras_zero_matches_data_parallel_np4(keras_backend: str) -> None:
    run_mpi(4, "keras_zero:equivalence", optimizers=["sgd", "adam"], stages=[1, 2], extras=False,
            timeout=400, env=env_for(keras_backend), shared=True)
