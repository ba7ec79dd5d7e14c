"""Keras ZeRO stage 3 on the JAX backend on real processes (mpirun, mpi backend)."""

import pytest

from keras_matrix import env_for, keras_backends
from mpi_harness import run_mpi

pytest.importorskip("keras")
pytest.importorskip("mpi4py")
pytest.importorskip("jax")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
JAX = env_for("jax")


@pytest.mark.parametrize("np_", [2, 4])
def test_keras_zero3_jax_fit_matches_one_process(np_: int) -> None:
    """SGD-momentum and Adam: weights, predict and evaluate equal one-process fit on the global batch."""
    run_mpi(np_, "keras_zero3_jax:equivalence", optimizers=["sgd", "adam"], timeout=300, env=JAX, shared=True)


def test_keras_zero3_jax_step_is_compiled_np2() -> None:
    run_mpi(2, "keras_zero3_jax:compiled_step", timeout=200, env=JAX, shared=True)


@pytest.mark.parametrize("np_", [2, 4])
def test_keras_zero3_jax_callbacks(np_: int) -> None:
    """Broadcast from ranks built with different seeds, metric average, LR warm-up."""
    run_mpi(np_, "keras_zero3_jax:callbacks", timeout=300, env=JAX, shared=True)


@pytest.mark.parametrize("np_", [2, 4])
def test_keras_zero3_jax_mixed_precision_skips_together(np_: int) -> None:
    run_mpi(np_, "keras_zero3_jax:mixed_precision", timeout=300, env=JAX, shared=True)


def test_keras_zero3_jax_regularizers_np4() -> None:
    """Weight regularizers and a loss a layer adds on its kernel: equal to one process (odd shards, padded)."""
    run_mpi(4, "keras_zero3_jax:regularized", timeout=300, env=JAX, shared=True)


def test_keras_zero3_jax_refusals_np2() -> None:
    run_mpi(2, "keras_zero3_jax:refusals", timeout=200, env=JAX, shared=True)


def test_keras_zero3_jax_sharded_build_np2() -> None:
    """sharded_build on JAX: the one-process initial values, then the one-process fit."""
    run_mpi(2, "keras_zero3_jax:sharded_build_matches", timeout=200, env=JAX, shared=True)
