"""Keras 3 data parallelism on real processes, on the TensorFlow, torch and JAX backends (mpirun)."""

import pytest

from keras_matrix import env_for, keras_backends
from mpi_harness import run_mpi

pytest.importorskip("keras")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_fit_matches_single_process_np2(keras_backend: str) -> None:
    run_mpi(2, "keras_dp:fit_equivalence", optimizers=["sgd", "adam"], timeout=240, env=env_for(keras_backend),
            shared=True)


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_fit_matches_single_process_np4(keras_backend: str) -> None:
    run_mpi(4, "keras_dp:fit_equivalence", optimizers=["sgd", "adam"], extras=False, timeout=300,
            env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", keras_backends("torch", "jax"))
def test_fit_on_the_torch_shardwise_backend_np2(keras_backend: str) -> None:
    """Keras on torch or JAX over shardwise's torch backend (gloo) instead of MPI."""
    run_mpi(2, "keras_dp:fit_equivalence", optimizers=["sgd", "adam"], extras=False, backend="torch",
            timeout=240, env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_callbacks_np2(keras_backend: str, tmp_path) -> None:
    run_mpi(2, "keras_dp:callbacks", tmpdir=str(tmp_path), timeout=240, env=env_for(keras_backend), shared=True)


def test_strategy_tensorflow_api_and_tape_np2() -> None:
    """MultiWorkerMirroredStrategy from MPI ranks, then the TF2 API and DistributedGradientTape."""
    pytest.importorskip("tensorflow")
    run_mpi(2, "keras_dp:tensorflow_api", with_strategy=True, timeout=240, env=env_for("tensorflow"))
