"""The checks that ranks agree before they exchange data: ZeRO-3 gathers and pipeline headers.

Two ranks are two threads of tests/unit/fake_group.py; the real processes are in
tests/distributed/test_divergence_mp.py.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.adapters.torch.parallel.pipeline_wire import make_header, read_header
from shardwise.adapters.torch.zero.agreement import GatherCheck, unit_label
from shardwise.adapters.torch.zero.units import ZeroUnit, stage3_units
from shardwise.core.comm import CompletedHandle
from shardwise.core.errors import CollectiveMismatchError, DivergenceError

sys.path.insert(0, str(Path(__file__).parent))
from fake_group import run_group  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 4)])
        self.scale = nn.Parameter(torch.ones(2))


class TorchFake:
    """A fake rank whose gathers into a preallocated tensor fill it (the fake engine deals in numpy)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def allgather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        out.copy_(torch.as_tensor(self.inner.allgather(tensor.numpy(), uniform=True)).view_as(out))
        return out

    def allgather_into_async(self, out: torch.Tensor, tensor: torch.Tensor) -> CompletedHandle:
        return CompletedHandle(self.allgather_into(out, tensor))


def _nets(n: int) -> list[Net]:
    """``n`` equal models, built here: the global RNG is not thread-safe to seed per rank."""
    torch.manual_seed(0)
    net = Net()
    return [copy.deepcopy(net) for _ in range(n)]


def _units(comm, net: Net) -> list[ZeroUnit]:
    comm = TorchFake(comm)
    return [ZeroUnit(i, named, comm, 3, torch.float32, torch.device("cpu"), module=m)
            for i, (m, named) in enumerate(stage3_units(net))]


def test_units_are_named_after_their_modules() -> None:
    nets = _nets(1)
    (result,) = run_group(1, lambda comm: [unit_label(u) for u in _units(comm, nets[0])])
    assert result == ["root parameters", "blocks.0", "blocks.1"]


def test_divergence_error_is_a_collective_mismatch() -> None:
    assert issubclass(DivergenceError, CollectiveMismatchError)


def _passes(orders: list[list[list[int]]]):
    """Run passes of gathers per rank (``orders[rank][pass]`` = unit indices); each rank's record."""
    nets = _nets(3)  # ranks 0 and 1, and the reference: a unit's gathered buffer is its flat parameters

    def body(comm):
        units = _units(comm, nets[comm.rank])
        check = GatherCheck(units[0].comm, units)
        for unit in units:
            unit.check = check
        for order in orders[comm.rank]:
            check.new_pass()
            for index in order:
                unit = units[index]
                unit.gather()
                want = torch.cat([dict(nets[2].named_parameters())[n].detach().reshape(-1) for n in unit.names])
                torch.testing.assert_close(unit._full[:unit.numel], want)
                unit.release()
        return check.plan, check.position, check.learned
    return run_group(2, body)


_TAIL = ": every rank must run the same modules in the same order (as FSDP and DeepSpeed ZeRO-3 require)"


def test_agreeing_passes_become_the_plan_and_gather_the_parameters() -> None:
    for r in _passes([[[1, 2, 1], [1, 2, 1], [1, 2]]] * 2):
        assert r == ([1, 2, 1], 2, None), r  # learned from the first pass, on plan from the second


def test_first_pass_different_units_raise_on_every_rank_naming_both() -> None:
    for r in _passes([[[1, 2]], [[1, 0]]]):
        assert isinstance(r, DivergenceError), r
        assert str(r) == ("ZeRO-3 ranks diverged at gather #1 of this pass: rank 0 gathered unit 2 (blocks.1, "
                          "72 bytes per rank), rank 1 unit 0 (root parameters, 4 bytes per rank)" + _TAIL)


@pytest.mark.parametrize("first, other", [(2, 1), (1, 2)])  # unit 1 is 288 bytes per rank, unit 2 is 72
def test_on_plan_a_rank_that_runs_another_unit_is_caught_on_every_rank(first: int, other: int) -> None:
    sizes = {1: 288, 2: 72}
    for r in _passes([[[1, 2], [1, 2], [first]], [[1, 2], [1, 2], [other]]]):
        assert isinstance(r, DivergenceError), r
        assert str(r) == (f"ZeRO-3 ranks diverged at gather #0 of this pass: rank 0 gathered unit {first} "
                          f"(blocks.{first - 1}, {sizes[first]} bytes per rank), rank 1 unit {other} "
                          f"(blocks.{other - 1}, {sizes[other]} bytes per rank)" + _TAIL)


def test_a_change_of_course_taken_by_every_rank_gathers_the_right_data_and_learns_again() -> None:
    for r in _passes([[[1, 2], [1, 2], [2, 1, 0], [2, 1, 0], [2, 1, 0]]] * 2):
        assert r == ([2, 1, 0], 0, None), r  # relearned over passes 4 and 5, on plan through pass 5


def test_a_new_pass_on_one_rank_only_is_caught() -> None:
    nets = _nets(2)

    def body(comm):
        units = _units(comm, nets[comm.rank])
        check = GatherCheck(units[0].comm, units)
        check.new_pass()
        check.start(units[1], blocking=True).wait()
        if comm.rank == 0:
            check.new_pass()
        check.start(units[1], blocking=True).wait()
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
