"""Elastic ZeRO on real processes: full optimizer state and resharding to fewer ranks.

Each stage's full state is checked on 2 or 4 ranks, and each stage is resharded
once (4 -> 2 or 2 -> 1), so that every stage and both sizes are covered without the
full 12-way product.
"""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_, stage", [(2, 1), (4, 2), (4, 3)])
def test_full_state_dict_equals_single_process_adam(np_, stage):
    run_mpi(np_, "zero_elastic:full_state", backend="mpi", stage=stage, timeout=240, shared=True)


@pytest.mark.parametrize("np_, to, stage", [(4, 2, 1), (2, 1, 2), (4, 2, 3)])
def test_reshard_to_fewer_ranks_continues_like_single_process(np_, to, stage):
    run_mpi(np_, "zero_elastic:shrink", backend="mpi", stage=stage, to=to, timeout=240, shared=True)
