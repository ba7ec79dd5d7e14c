"""Elastic ZeRO on real processes: full optimizer state and resharding to fewer ranks."""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("np_", [2, 4])
def test_full_state_dict_equals_single_process_adam(np_, stage):
    run_mpi(np_, "zero_elastic:full_state", backend="mpi", stage=stage, timeout=240)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("np_, to", [(4, 2), (2, 1)])
def test_reshard_to_fewer_ranks_continues_like_single_process(np_, to, stage):
    run_mpi(np_, "zero_elastic:shrink", backend="mpi", stage=stage, to=to, timeout=240)
