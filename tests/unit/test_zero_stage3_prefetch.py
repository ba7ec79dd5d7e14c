"""ZeRO stage 3 in one process: backward prefetch order, reused and unused units, uniform gathers."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.backends.local import LocalCommunicator
from shardwise.core.comm import Handle
from shardwise.core.errors import ConfigError


class Recording(LocalCommunicator):
    """Logs each parameter allgather as ("gather" | "prefetch", unit index, uniform)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self.owner: dict[int, int] = {}
        self._blocking = False

    def allgather(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Any:
        self._blocking = True
        try:
            return super().allgather(tensor, name=name, uniform=uniform)
        finally:
            self._blocking = False

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        unit = self.owner.get(tensor.data_ptr())
        if unit is not None:
            self.log.append(("gather" if self._blocking else "prefetch", unit, uniform))
        return super().allgather_async(tensor, name=name, uniform=uniform)


class Chain(nn.Module):
    def __init__(self, reuse: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.unused = nn.Linear(6, 6)
        self.reuse = reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.layers[0](x) if self.reuse else x


def _setup(reuse: bool = False, reshard: bool = True) -> tuple[Chain, ZeroOptimizer, Recording]:
    torch.manual_seed(0)
    model, comm = Chain(reuse), Recording()
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=3, comm=comm, lr=0.1, reshard_after_forward=reshard)
    comm.owner = {u.shard.data_ptr(): u.index for u in opt.units}
    for unit in opt.units:
        for p in unit.params:
            p.register_post_accumulate_grad_hook(lambda p, i=unit.index: comm.log.append(("grad", i)))
    return model, opt, comm


def _reference(reuse: bool) -> tuple[Chain, torch.optim.Optimizer]:
    torch.manual_seed(0)
    ref = Chain(reuse)
    return ref, torch.optim.SGD(ref.parameters(), lr=0.1)


def test_backward_prefetches_the_previous_unit_before_this_units_gradients() -> None:
    model, opt, comm = _setup()
    index = {id(u.module): u.index for u in opt.units}
    first, last = index[id(model.layers[0])], index[id(model.layers[3])]
    for step in range(2):  # the first step too: backward uses this step's forward order
        loss = model(torch.ones(2, 6)).sum()
        comm.log.clear()
        loss.backward()
        order = [index[id(model.layers[k])] for k in (3, 2, 1, 0)]
        gathers = [e[1] for e in comm.log if e[0] in ("gather", "prefetch")]
        assert gathers == order, f"step {step}: gathers in backward {comm.log}"
        assert comm.log[0] == ("gather", last, True)
        for k in range(3):  # unit k+1 of the backward order is requested before unit k's gradients
            ask = comm.log.index(("prefetch", order[k + 1], True))
            assert ask < comm.log.index(("grad", order[k])), comm.log
        assert first in [e[1] for e in comm.log if e[0] == "grad"]
        assert all(u.pending is None and not u.gathered for u in opt.units), "prefetch left behind"
        opt.step()
        opt.zero_grad()


def test_reused_and_unused_units_match_plain_autograd() -> None:
    model, opt, comm = _setup(reuse=True)
    ref, ref_opt = _reference(True)
    for step in range(3):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert all(u.pending is None for u in opt.units)
    got = opt.full_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), msg=name)


@pytest.mark.parametrize("reuse", [False, True])
def test_without_reshard_after_forward_backward_gathers_nothing(reuse: bool) -> None:
    model, opt, comm = _setup(reuse=reuse, reshard=False)
    ref, ref_opt = _reference(reuse)
    used = {u.index for u in opt.units if u.module is not None and u.module is not model.unused}
    for step in range(3):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
        comm.log.clear()
        loss = model(x).square().mean()
        assert {e[1] for e in comm.log if e[0] in ("gather", "prefetch")} == used
        assert all(u.gathered for u in opt.units if u.index in used), "freed after forward"
        comm.log.clear()
        loss.backward()
        assert not [e for e in comm.log if e[0] in ("gather", "prefetch")], comm.log
        assert not any(u.gathered or u.pending for u in opt.units), "kept after backward"
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = opt.full_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), msg=name)


def test_units_kept_by_a_forward_without_backward_are_freed_when_the_step_changes_them() -> None:
    model, opt, _ = _setup(reshard=False)
    ref, ref_opt = _reference(False)
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    model(x).square().mean().backward()
    model(y)  # needs gradients, never back-propagated: its units stay gathered
    assert any(u.gathered for u in opt.units)
    opt.step()
    assert not any(u.gathered for u in opt.units), "stale full parameters kept past the step"
    ref(x).square().mean().backward()
    ref_opt.step()
    with torch.no_grad():
        torch.testing.assert_close(model(y), ref(y))
    assert not any(u.gathered for u in opt.units), "a forward without gradients keeps nothing"


def test_reshard_after_forward_false_is_refused_below_stage_3() -> None:
    with pytest.raises(ConfigError, match="stage 3"):
        ZeroOptimizer(Chain(), torch.optim.SGD, stage=2, comm=LocalCommunicator(), lr=0.1, reshard_after_forward=False)
