"""Pipeline, tensor and data parallelism on 2 and 4 real processes, against one-process training."""


import pytest

from keras_matrix import env_for, keras_backends
from example_results import example_result
from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi



@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_pp2_schedules_and_tp2(backend: str) -> None:
    run_mpi(2, "parallel3d:two_ranks", backend=backend, timeout=240, shared=True)


def test_pp4_dp_pp_dp_tp_pp_tp() -> None:
    run_mpi(4, "parallel3d:four_ranks", backend="mpi", timeout=240, shared=True)


def test_gpt_example_trains() -> None:
    result = run_mpi(4, "parallel3d:gpt_example", argv=["--pp", "2", "--tp", "2", "--steps", "12"], timeout=240,
                     shared=True)
    found = example_result(result.output, "gpt_3d")
    losses = found["losses"]
    assert (found["ranks"], found["dp"], found["tp"], found["pp"]) == (4, 1, 2, 2), found
    assert found["steps"] == 12 and len(losses) == 12 and found["loss"] == losses[-1], found
    assert found["loss"] < losses[0] - 0.5, found


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_keras_pp2_matches_single_process(keras_backend: str) -> None:
    run_mpi(2, "keras_pp:train", schedules=[["gpipe", 3], ["1f1b", 4], ["gpipe", 1]], timeout=240,
            env=env_for(keras_backend), shared=True)


@pytest.mark.parametrize("keras_backend", keras_backends())
def test_keras_dp2_pp2_on_the_mesh_groups_matches_single_process(keras_backend: str) -> None:
    result = run_mpi(4, "keras_pp:train_dp", schedules=[["1f1b", 2]], timeout=240, env=env_for(keras_backend),
                     shared=True)
    assert result.output.count("OK keras dp2 x pp2") == 4, result.output[-3000:]
