"""The checks that ranks agree before they exchange data: ZeRO-3 gathers and pipeline headers.

Two ranks are two threads of tests/unit/fake_group.py; the real processes are in
tests/distributed/test_divergence_mp.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.adapters.torch.parallel.pipeline_wire import make_header, read_header
from shardwise.adapters.torch.zero.agreement import GatherCheck, unit_label
from shardwise.adapters.torch.zero.units import ZeroUnit, stage3_units
from shardwise.core.errors import CollectiveMismatchError, DivergenceError

sys.path.insert(0, str(Path(__file__).parent))
from fake_group import run_group  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2)])
        self.scale = nn.Parameter(torch.ones(2))


def _units(comm) -> list[ZeroUnit]:
    torch.manual_seed(0)
    return [ZeroUnit(i, named, comm, 3, torch.float32, torch.device("cpu"), module=m)
            for i, (m, named) in enumerate(stage3_units(Net()))]


def test_units_are_named_after_their_modules() -> None:
    (result,) = run_group(1, lambda comm: [unit_label(u) for u in _units(comm)])
    assert result == ["root parameters", "blocks.0", "blocks.1"]


def test_divergence_error_is_a_collective_mismatch() -> None:
    assert issubclass(DivergenceError, CollectiveMismatchError)


def _check(order: list[list[int]]):
    def body(comm):
        units = _units(comm)
        check = GatherCheck(comm, units)
        for index in order[comm.rank]:
            check(units[index])
        return check.sequence
    return run_group(2, body)


def test_agreeing_gathers_pass_and_count() -> None:
    assert _check([[1, 2, 1], [1, 2, 1]]) == [3, 3]


def test_different_units_raise_on_every_rank_naming_both() -> None:
    results = _check([[1, 2], [1, 0]])
    for r in results:
        assert isinstance(r, DivergenceError), r
        assert str(r) == ("ZeRO-3 ranks diverged at gather #1 of this pass: rank 0 gathered unit 2 (blocks.1, "
                          "20 bytes per rank), rank 1 unit 0 (root parameters, 4 bytes per rank): every rank must "
                          "run the same modules in the same order (as FSDP and DeepSpeed ZeRO-3 require)")


def test_a_new_pass_restarts_the_count_on_one_rank_only_is_caught() -> None:
    def body(comm):
        units = _units(comm)
        check = GatherCheck(comm, units)
        check(units[1])
        if comm.rank == 0:
            check.new_pass()
        check(units[1])
    for r in run_group(2, body):
        assert isinstance(r, DivergenceError) and "as gather #0 of its pass" in str(r) \
            and "as gather #1 of its pass" in str(r), r


def test_pipeline_header_names_step_microbatch_and_stage() -> None:
    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    header = make_header(x, step=4, microbatch=0, stage=2)
    assert read_header(header, 4, 0, 2, source=1, rank=2) == ((2, 3), torch.bfloat16)
    with pytest.raises(DivergenceError, match=r"expected the activation header of step 5, micro-batch 0 for "
                                              r"model stage 2 from rank 1, and got step 4"):
        read_header(header, 5, 0, 2, source=1, rank=2)
