"""The mpi backend's device tensors through a torch group (gloo stands in for NCCL on the CPU)."""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

ROUTE = {"SHARDWISE_DEVICE_ENGINE": "gloo"}


@pytest.mark.parametrize("np_", [2, 4])
def test_mpi_backend_sends_torch_tensors_through_the_torch_group(np_):
    result = run_mpi(np_, "device_routing:routes_through_torch_group", backend="mpi", env=ROUTE, timeout=180)
    assert result.output.count("OK rank") == np_, result.output[-3000:]


def test_zero_over_the_route_equals_plain_data_parallel():
    run_mpi(2, "zero_scenarios:equivalence", backend="mpi", env=ROUTE, timeout=300)


def test_route_steps_name_their_device():
    result = run_mpi(2, "device_correct:steps_name_their_device", backend="mpi", env=ROUTE, timeout=300)
    assert result.output.count("OK rank") == 2, result.output[-3000:]


def test_pipeline_and_tensor_parallel_meshes_over_the_route_match_one_process():
    """Mesh groups are splits of the world; each pipeline's channel is the first duplicate of one (its spare)."""
    run_mpi(4, "parallel3d:four_ranks", backend="mpi", env=ROUTE, timeout=300)


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_sub_groups_made_by_their_members(backend):
    """torch names groups by a job-wide counter: a sub-group's split made its members' counters run ahead,
    and every group the whole job made afterwards hung (torch backend); on mpi such splits had no route."""
    result = run_mpi(4, "device_routing:sub_groups_made_by_their_members", backend=backend,
                     env=ROUTE if backend == "mpi" else None, timeout=180)
    assert result.output.count("OK rank") == 4, result.output[-3000:]
