"""Keras 3 mixed precision and XLA with no shardwise callback, on real processes (mpirun).

Without one finite decision for all ranks the first test hangs (the timeout fails
it) or ends with weights that differ between ranks.
"""

import pytest

from keras_matrix import env_for, keras_backends
from mpi_harness import run_mpi

pytest.importorskip("keras")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

#: compile's LossScaleOptimizer, the user's, one around ZeroOptimizer, and a model with its own train_step.
VARIANTS = ["compiled", "outer", "zero", "custom_step"]


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_one_rank_overflows_every_rank_skips_np2(keras_backend: str) -> None:
    """mixed_float16, fit(callbacks=[]): rank 1 overflows at step 2; both ranks skip it, as one process does."""
    run_mpi(2, "keras_nonfinite:overflow_skipped_together", variants=VARIANTS, timeout=240,
            env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", keras_backends("tensorflow"))
def test_fit_turns_xla_off_without_callbacks_np2(keras_backend: str) -> None:
    run_mpi(2, "keras_nonfinite:xla_off_without_callbacks", timeout=180, env=env_for(keras_backend), shared=True)
