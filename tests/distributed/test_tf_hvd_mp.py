"""Horovod semantics of shardwise.tensorflow under real mpirun: values, errors, gradients, tape, join.

The scenarios are in tf_hvd.py; each runs every check eagerly, in tf.function and
in a TF1 session, as Horovod's own suite does (run that suite with
../shared/peer-suites/run-horovod-suite.sh test_tensorflow.py shardwise).
"""

import pytest

from mpi_harness import run_mpi

pytest.importorskip("tensorflow")
pytest.importorskip("mpi4py")

pytestmark = pytest.mark.mpi

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(150)
def test_tf_hvd_2_ranks() -> None:
    """collectives, errors, gradients_and_training in one job: TensorFlow starts once per rank."""
    run_mpi(2, "tf_hvd:all_scenarios", timeout=120, env=ENV)
