"""Keras 3 ZeRO stage 3 on the torch Keras backend, on real processes (mpirun, 2 and 4 ranks)."""

import pytest

from keras_matrix import env_for, keras_backends
from mpi_harness import run_mpi

pytest.importorskip("keras")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
TORCH = keras_backends("torch")


@pytest.mark.parametrize("keras_backend", TORCH)
def test_keras_zero3_matches_one_process_np2(keras_backend: str) -> None:
    """SGD-momentum and Adam against one process; weight I/O, callbacks and refusals."""
    run_mpi(2, "keras_zero3:equivalence", optimizers=["sgd", "adam"], timeout=300,
            env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", TORCH)
def test_keras_zero3_matches_one_process_np4(keras_backend: str) -> None:
    run_mpi(4, "keras_zero3:equivalence", optimizers=["sgd", "adam"], extras=False, timeout=300,
            env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", TORCH)
@pytest.mark.parametrize("np_", [2, 4])
def test_keras_zero3_mixed_precision_overflow(keras_backend: str, np_: int) -> None:
    run_mpi(np_, "keras_zero3:mixed_precision", timeout=300, env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", TORCH)
@pytest.mark.parametrize("np_", [2, 4])
def test_keras_zero3_sharded_build(keras_backend: str, np_: int) -> None:
    run_mpi(np_, "keras_zero3:sharded_build", timeout=300, env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", TORCH)
def test_keras_zero3_divergence_np2(keras_backend: str) -> None:
    """A fresh job: the diverged ranks' communicator is not reused by later scenarios."""
    run_mpi(2, "keras_zero3:divergence", timeout=200, env=env_for(keras_backend))


@pytest.mark.parametrize("keras_backend", TORCH)
@pytest.mark.parametrize("np_", [2, 4])
def test_keras_zero3_regularizers(keras_backend: str, np_: int) -> None:
    """Weight regularizers (also under mixed_float16 and on a layer whose output reaches no loss) and a loss a
    layer adds on its kernel: equal to one process (at 2 ranks also with jit_compile=True). They were refused
    before."""
    run_mpi(np_, "keras_zero3:regularized", jit=np_ == 2, timeout=300, env=env_for(keras_backend), shared=True)
