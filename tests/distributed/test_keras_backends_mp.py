"""Keras 3 on torch and JAX: Horovod's collectives without TensorFlow; mixed precision on every backend."""


import pytest

from keras_matrix import env_for, keras_backends
from example_results import example_result
from mpi_harness import run_mpi

pytest.importorskip("keras")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("keras_backend", keras_backends("torch", "jax"))
def test_horovod_api_without_tensorflow_np2(keras_backend: str) -> None:
    run_mpi(2, "keras_backends:portable_api", timeout=180, env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_mixed_precision_same_decision_on_every_rank_np2(keras_backend: str) -> None:
    """One rank overflows: every rank skips that step and halves its scale (without it: a hang)."""
    run_mpi(2, "keras_backends:mixed_precision", timeout=180, env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_digits_example_on_each_backend_np2(keras_backend: str) -> None:
    pytest.importorskip("sklearn")
    result = run_mpi(2, "keras_backends:digits_example", argv=["--backend", keras_backend, "--epochs", "4"],
                     timeout=240, env=env_for(keras_backend), shared=True)
    found = example_result(result.output, "keras_digits")
    assert (found["backend"], found["ranks"], found["epochs"]) == (keras_backend, 2, 4), found
    assert found["test_samples"] == 360, found  # 20% of the 1797 digits, every test sample counted once
    assert 0 < found["loss"] < 1.0 and found["test_accuracy"] > 0.85, found


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_recompiled_with_a_plain_optimizer_np2(keras_backend: str) -> None:
    run_mpi(2, "keras_backends:replaced_optimizer", timeout=180, env=env_for(keras_backend), shared=True)
